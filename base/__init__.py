"""base/: what model.py's seams and the numbered lessons build on, below them: the attention
kernels, which checkpointed block runs (03's recompute flag), pinned host buffers.
support/: what the commands use, above the lessons (building, run time, byte counts, ...).
Nothing here imports the project outside base/; each module says which lessons it serves."""
