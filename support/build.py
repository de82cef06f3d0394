"""build.py - a model that never exists whole in one process.

The model is created on the meta device (shapes, no memory), its attention is given the fast
kernels (base/kernels.py: model.py alone runs plain SDPA) and its SwiGLU and rotary their fused
forms (base/fused.py), the techniques rewrite its seams,
01's FSDP shards it, and only then does each rank allocate and initialize its own shard: an 8B
model is never materialized whole. train.py builds this way, and so does `build_from_hf`, whose
weights then fill the shards from a Hugging Face folder (support/pretrained.py reads them and
each rank loads only its slices). What of this is about
distribution lives here, so that model.py knows nothing of it: allocating the shards, tying the
embeddings again after that, and drawing each rank's rows of the initial weights.
"""

import torch

import model
from base import fused, kernels
from support import pretrained
from support.lessons import sharding


def build_model(args, device: torch.device, mesh=None, compute_dtype=torch.float32,
                seed: int = 0, exact_init: bool = True, before_sharding=None,
                offload_model_state: bool = False):
    """Build, optionally transform, shard and initialize a model.

    Seam 1 gets base/kernels.py's attention (`use_kernels`), then `before_sharding(model)`
    applies the seam-level techniques (02-06) on the meta device; with a `mesh` FSDP shards
    the model, and each rank's shard is then allocated and initialized.
    With offload_model_state the shards are allocated in host memory (model.py's model has no
    buffers to place). exact_init: initialize as the unsharded model would (model.init_weights).
    """
    with torch.device("meta"):
        transformer = model.Transformer(args)
    use_kernels(transformer)
    fused.use_fused(transformer)
    if before_sharding is not None:
        before_sharding(transformer)
    if mesh is not None:
        sharding.apply_fsdp(transformer, mesh, compute_dtype, offload_model_state)
    elif offload_model_state:
        raise ValueError("--offload-model-state is a setting of FSDP (01): add --fsdp")
    allocate(transformer, "cpu" if offload_model_state else device)
    if mesh is None:
        model.init_weights(transformer, seed, exact=exact_init)
    else:
        init_sharded_weights(transformer, seed, exact=exact_init)
    if mesh is None and compute_dtype != torch.float32:
        transformer.to(compute_dtype)  # single process, no FSDP: plain low-precision training
    return transformer


def build_from_hf(path: str, device: torch.device, mesh=None, compute_dtype=torch.float32,
                  before_sharding=None, args=None, use_dcp: bool = True,
                  offload_model_state: bool = False):
    """(model, args): the model of the Hugging Face folder `path` (train.py --init-from), built
    as `build_model` builds (its techniques applied by `before_sharding`, sharded over `mesh`)
    and filled from the files.

    args: the ModelArgs to build (default: read from config.json); pass them to change what the
    checkpoint does not fix (e.g. the rotary scaling to train with), shapes must match."""
    args = args or pretrained.model_args_from_hf(path)
    with torch.device("meta"):  # the checks before anything is allocated
        pretrained.check_checkpoint(model.Transformer(args), path)
    transformer = build_model(args, device, mesh, compute_dtype, exact_init=False,
                              before_sharding=before_sharding,
                              offload_model_state=offload_model_state)
    pretrained.load_hf_weights(transformer, path, use_dcp=use_dcp)
    return transformer, args


def use_kernels(transformer) -> None:
    """Seam 1 runs base/kernels.py's causal attention (FlashAttention-4, cuDNN, ... as
    --attn-kernel picks) instead of model.py's plain SDPA: the techniques then wrap that."""
    for block in transformer.layers:
        block.self_attn.core = kernels.causal_attention


def allocate(transformer, device) -> None:
    """Give the parameters of a model built on the meta device memory on `device` (each rank
    only its shards), uninitialized. `to_empty` gives every module a new Parameter, so tied
    embeddings would become two matrices: lm_head takes embed_tokens' Parameter again."""
    transformer.to_empty(device=device)
    if transformer.args.tie_word_embeddings:
        transformer.lm_head.weight = transformer.embed_tokens.weight


@torch.no_grad()
def init_sharded_weights(transformer, seed: int = 0, exact: bool = True) -> None:
    """model.init_weights for a model FSDP2 has sharded: each rank fills only its shards.

    exact=True: each parameter is drawn whole (model.init_weights' draws, in its order) and
    only this rank's rows are kept, so a sharded model starts bit-identical to the unsharded
    one (tests). exact=False: each rank draws its own shard on its device from its own stream.
    """
    generator = torch.Generator().manual_seed(seed)
    for index, (name, param) in enumerate(transformer.named_parameters()):
        local = param.to_local()  # this rank's shard of the DTensor
        if model.is_norm(name):
            local.fill_(1.0)
        elif exact:
            full = torch.randn(param.shape, generator=generator) * model.INIT_STD
            local.copy_(local_rows(full, param.device_mesh))
        else:
            shard = param.device_mesh.get_local_rank()
            stream = model.own_stream(seed, index, local.device, part=shard)
            local.normal_(0.0, model.INIT_STD, generator=stream)


def local_rows(full: torch.Tensor, mesh) -> torch.Tensor:
    """The rows of `full` that this rank holds: FSDP2 shards dim 0 like torch.chunk."""
    chunks = full.chunk(mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    return chunks[rank] if rank < len(chunks) else full[:0]
