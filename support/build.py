"""build.py - a model that never exists whole in one process.

The model is created on the meta device (shapes, no memory), the techniques rewrite its seams,
01's FSDP shards it, and only then does each rank allocate and initialize its own shard: an 8B
model is never materialized whole. train.py builds this way; so do support/pretrained.py (whose
weights then fill the shards from a Hugging Face folder) and 03's demo.
"""

import importlib

import torch

from model import Transformer, init_weights

fsdp = importlib.import_module("01_fsdp")  # the numbered files start with a digit


def build_model(args, device: torch.device, mesh=None, compute_dtype=torch.float32,
                seed: int = 0, exact_init: bool = True, before_sharding=None,
                offload_model_state: bool = False):
    """Build, optionally transform, shard and initialize a model.

    `before_sharding(model)` applies the seam-level techniques (02-05) on the meta device; with
    a `mesh` FSDP shards the model, and each rank's shard is then allocated and initialized.
    With offload_model_state the shards are allocated in host memory (model.py's model has no
    buffers to place). exact_init: initialize as the unsharded model would (model.init_weights).
    """
    with torch.device("meta"):
        model = Transformer(args)
    if before_sharding is not None:
        before_sharding(model)
    if mesh is not None:
        fsdp.apply_fsdp(model, mesh, compute_dtype, offload_model_state)
    elif offload_model_state:
        raise ValueError("--offload-model-state is a setting of FSDP (01): add --fsdp")
    model.to_empty(device="cpu" if offload_model_state else device)
    init_weights(model, seed, exact=exact_init)
    if mesh is None and compute_dtype != torch.float32:
        model.to(compute_dtype)  # single process, no FSDP: plain low-precision training
    return model
