"""runtime.py - the processes of a run: world = data-parallel x sequence-parallel ranks.

`check_layout` holds a Config against a number of ranks and the techniques' own constraints
(02's heads and sequence split, 05's head chunk, 04's tile sizes): training runs it before
building anything, plan.py runs the same for the GPUs it plans. `setup_runtime` joins the
process group (or starts a group of one) and builds the meshes. Above the techniques it checks,
below the commands that use it (train.py, eval.py, plan.py).
"""

import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from support import kernels
from support.config import Config, model_args

# The numbered files start with a digit, so they are imported by name.
ulysses = importlib.import_module("02_ulysses")
tiling = importlib.import_module("04_alst_tiling")
untied = importlib.import_module("05_untied_ulysses")


@dataclass
class Runtime:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    dp_rank: int = 0
    dp: int = 1
    sp_rank: int = 0
    sp: int = 1
    sp_group: object = None
    fsdp_mesh: object = None


def setup_runtime(cfg: Config) -> Runtime:
    """Join (or start a one-process) process group when a technique needs one."""
    needs_group = cfg.fsdp or cfg.ulysses or cfg.untied
    launched = "WORLD_SIZE" in os.environ
    if not dist.is_initialized() and (launched or needs_group):
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if cfg.device == "cuda" and cfg.offload_model_state:
            # Gradient clipping reduces the norms of the host-resident gradient shards: CPU
            # tensors, which NCCL cannot reduce; gloo takes those.
            backend = "cpu:gloo,cuda:nccl"
        if launched:
            dist.init_process_group(backend)
        else:  # `python train.py --stack 5`: a group of one, its store in memory (no port)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    kernels.use_kernel(cfg.attn_kernel)
    rt = Runtime()
    if dist.is_initialized():
        rt.rank, rt.world = dist.get_rank(), dist.get_world_size()
    if cfg.device == "cuda":
        rt.device = torch.device("cuda", torch.cuda.current_device())
    rt.sp, _ = check_layout(cfg, rt.world, model_args(cfg))
    if dist.is_initialized():
        mesh = ulysses.data_sequence_mesh(cfg.device, rt.sp)
        rt.dp_rank, rt.dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        rt.sp_rank, rt.sp_group = mesh["sp"].get_local_rank(), mesh["sp"].get_group()
        if cfg.fsdp:
            from torch.distributed.device_mesh import init_device_mesh

            rt.fsdp_mesh = init_device_mesh(cfg.device, (rt.world,))
    return rt


def check_layout(cfg: Config, world_size: int, args) -> tuple:
    """(sequence-parallel degree, head chunk) of `cfg` on `world_size` ranks, or a ValueError
    naming the constraint. Training runs it before building anything; plan.py runs the same."""
    if world_size < 1:
        raise ValueError(f"--gpus must be at least 1, got {world_size}")
    if world_size > 1 and not cfg.fsdp:
        raise ValueError(f"{world_size} processes need --fsdp (01) to keep the model in sync; "
                         f"add --fsdp or --stack 1 or higher")
    sequence_parallel = cfg.ulysses or cfg.untied
    sp = (cfg.sp or world_size) if sequence_parallel else 1
    if cfg.sp is not None and not sequence_parallel:
        raise ValueError("--sp needs --ulysses or --untied")
    ulysses.check_data_sequence_layout(world_size, sp)
    if sequence_parallel:
        ulysses.check_ulysses_shapes(args.n_heads, args.n_kv_heads, sp, cfg.seq_len)
    head_chunk = (untied.check_head_chunk(args.n_heads, args.n_kv_heads, sp, cfg.head_chunk)
                  if cfg.untied else None)
    tiling.check_tile_tokens("mlp_tile_tokens", cfg.mlp_tile_tokens)
    tiling.check_tile_tokens("loss_tile_tokens", cfg.loss_tile_tokens)
    return sp, head_chunk
