"""byte_counts.py - the planner's byte formulas: what each technique holds per rank, in bytes.

plan.py adds these up into a step's peak; the lessons (01..06) hold the techniques themselves
and name their problem in bytes in their docstrings. One section per lesson, in file order; the
calibration (docs/calibration.md, tests/test_plan.py) holds each formula to measured peaks.
"""


# ---- 01_fsdp.py: model state, sharded; FSDP2's gathered copies; the state on the host -------



# ---- 02_ulysses.py: one attention layer's activations per rank -----------------------------



# ---- 03_checkpoint_offload.py: saved block inputs, on the GPU or the host; a block's recompute



# ---- 04_alst_tiling.py: the MLP's, the loss's and the norms' token-sized temporaries --------



# ---- 05_untied_ulysses.py: one headwise stage at a time -------------------------------------



# ---- 06_ring_attention.py: a ring rank's K/V blocks in flight -------------------------------
