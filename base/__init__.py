"""base/: what the numbered lessons build on, below them: the attention kernels (the build puts
them in model.py's seam 1), fused elementwise kernels (SwiGLU, rotary, cross-entropy), which
checkpointed block runs (03's recompute flag, keep-attention's seam), pinned host buffers, where
FSDP2's gradients take their memory. Nothing here imports the project outside base/.
support/: what the commands use, above the lessons (building, run time, byte counts, ...)."""
