"""support/: what the commands (train.py, eval.py, plan.py, bench/) use, above the lessons:
building, run time, configuration, byte counts, data, saved state, checkpoints in and out.
base/: what the lessons themselves use, below them (kernels, the recompute flag, host buffers).
Imports point down only: support/ -> the numbered files (support/lessons.py) -> model.py, base/."""
