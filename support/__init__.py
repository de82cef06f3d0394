"""support/: what the commands (train.py, eval.py, plan.py, bench/, the lessons' demos) use, above
the lessons: building, run time, configuration, byte counts, data, saved state, checkpoints.
base/: what the lessons themselves use, below them (kernels, the recompute flag, host buffers).
Imports point down: support/ -> the lessons (support/lessons.py) -> model.py and base/; a
lesson's demo, below its marker, is a command and imports support/ when it runs."""
