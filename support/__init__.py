"""The plumbing shared by the numbered files and the commands: attention kernels, data, run
configuration, saved training state, Hugging Face checkpoints in and out, demo helpers. Nothing
here is one of the lessons; each module says which of them it serves."""
