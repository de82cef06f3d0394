"""runtime.py - the processes of a run: world = data-parallel x sequence-parallel ranks, and the
sequence-parallel ranks as Ulysses P/R x ring R (06).

`check_layout` holds a Config against a number of ranks and the techniques' own constraints
(02's heads and sequence split, 05's head chunk, 06's ring, 04's tile sizes): training runs it
before building anything, plan.py runs the same for the GPUs it plans. `ring_degree` picks R
when --ring is not given. `read_machine` reads what the planner decides a GPU run with (the
smallest GPU, the least host memory, the GPU's kind), the same on every rank; `setup_runtime`
joins the process group (or starts a group of one) and builds the meshes. Above the techniques
it checks, below the commands that use it (train.py, eval.py, plan.py).
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from base import kernels
from support.config import AUTO, Config, model_args
from support.host_memory import available_host_memory
from support.lessons import ring_sp, tiling, ulysses_sp, untied_sp

# PyTorch's caching allocator keeps freed blocks at their sizes; at long lengths a step's
# tensors come in many sizes (tiles, stages, the last tile's remainder), and the gaps between them
# grew to 3.8-16 GiB reserved but unallocated when a rehearsed record ran out of memory at
# dfc7e27 (docs/results.md, "rehearsing"). Expandable segments map memory in pages as it is
# needed, so freed space can be reused by any size. Read when the allocator first runs: set here,
# before any CUDA tensor exists, unless the user set the variable.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


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
    ring: int = 1  # 06: the sequence-parallel ranks as Ulysses P/R x ring R
    ulysses_group: object = None  # the P/R contiguous ranks of one all-to-all
    ring_group: object = None  # the R ranks at stride P/R that pass K/V around
    fsdp_mesh: object = None

    @property
    def ulysses(self) -> int:
        """Ranks of one all-to-all: P, or P/R with a ring."""
        return self.sp // self.ring

    def token_order(self, seq_len: int):
        """The order tokens are split over the sequence-parallel ranks in: None (as they come),
        or 06's zigzag with a ring (each ring rank's two chunks, one early, one late)."""
        return ring_sp.zigzag_order(seq_len, self.ring) if self.ring > 1 else None


@dataclass(frozen=True)
class Machine:
    """What the planner (plan.plan_run) decides a GPU run with; every rank reads the same."""
    gpus: int
    gpu_name: str | None  # torch.cuda.get_device_name(): the speed model's rates by kind
    gpu_mem: int  # bytes of the smallest GPU
    host_mem: int | None  # bytes the host can still hand out (the least any rank sees), per node
    gpus_per_node: int  # the GPUs that share that host memory


def read_machine(cfg: Config) -> Machine | None:
    """The GPUs and host memory of this run, the least any rank has (a choice made from them,
    such as a head chunk, must be the same on every rank); None on the CPU, where nothing is
    planned. Under torchrun it joins the process group first."""
    if cfg.device != "cuda":
        return None
    # join_processes sets the GPU from LOCAL_RANK when it starts the group; a caller that
    # started the group itself (tests/ranks.py, ranks sharing a GPU) has set it already
    join_processes(cfg)
    device = torch.device("cuda", torch.cuda.current_device())
    least = torch.tensor([torch.cuda.get_device_properties(device).total_memory,
                          available_host_memory() or -1], device=device)
    if dist.is_initialized():
        dist.all_reduce(least, op=dist.ReduceOp.MIN)
    gpu_mem, host_mem = (int(n) for n in least.tolist())
    return Machine(gpus=dist.get_world_size() if dist.is_initialized() else 1,
                   gpu_name=torch.cuda.get_device_name(device), gpu_mem=gpu_mem,
                   host_mem=host_mem if host_mem >= 0 else None,
                   gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def join_processes(cfg: Config) -> None:
    """Join (or start a one-process) process group when a technique needs one, or torchrun
    started several."""
    needs_group = cfg.fsdp or cfg.ulysses or cfg.untied
    launched = "WORLD_SIZE" in os.environ
    if dist.is_initialized() or not (launched or needs_group):
        return
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if cfg.device == "cuda" else "gloo"
    if cfg.device == "cuda" and (cfg.offload_model_state or cfg.offload_moments
                                 or cfg.stack == AUTO):
        # Gradient clipping reduces the norms of the host-resident gradient shards, and a save
        # or load of 09's host moments runs collectives on them: CPU tensors, which NCCL cannot
        # take; gloo takes those. (--stack auto joins before it knows what goes to the host.)
        backend = "cpu:gloo,cuda:nccl"
    if launched:
        dist.init_process_group(backend)
    else:  # `python train.py --stack 5`: a group of one, its store in memory (no port)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def setup_runtime(cfg: Config) -> Runtime:
    """The process group (join_processes) and this rank's place in it: data x sequence."""
    join_processes(cfg)
    kernels.use_kernel(cfg.attn_kernel)
    rt = Runtime()
    if dist.is_initialized():
        rt.rank, rt.world = dist.get_rank(), dist.get_world_size()
    if cfg.device == "cuda":
        rt.device = torch.device("cuda", torch.cuda.current_device())
    args = model_args(cfg)
    rt.sp, rt.ring, _ = check_layout(cfg, rt.world, args)
    if dist.is_initialized():
        mesh = data_sequence_mesh(cfg.device, rt.sp)
        rt.dp_rank, rt.dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        rt.sp_rank, rt.sp_group = mesh["sp"].get_local_rank(), mesh["sp"].get_group()
        rt.ulysses_group = rt.sp_group
        if rt.ring > 1:  # sp rank = ring rank x P/R + Ulysses rank, as the zigzag data expects
            grid = ring_sp.ring_ulysses_mesh(cfg.device, rt.sp, rt.ring)
            rt.ulysses_group, rt.ring_group = grid["ulysses"].get_group(), grid["ring"].get_group()
        if cfg.fsdp:
            from torch.distributed.device_mesh import init_device_mesh

            rt.fsdp_mesh = init_device_mesh(cfg.device, (rt.world,))
    return rt


def data_sequence_mesh(device_type: str, sp: int):
    """Ranks as a (dp, sp) grid; sequence-parallel groups are contiguous ranks (one node)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    ulysses_sp.check_data_sequence_layout(world, sp)
    return init_device_mesh(device_type, (world // sp, sp), mesh_dim_names=("dp", "sp"))


def check_layout(cfg: Config, world_size: int, args) -> tuple:
    """(sequence-parallel degree P, ring degree R, head chunk U) of `cfg` on `world_size` ranks,
    or a ValueError naming the constraint. Training runs it before building anything; plan.py
    runs the same."""
    if world_size < 1:
        raise ValueError(f"--gpus must be at least 1, got {world_size}")
    if world_size > 1 and not cfg.fsdp:
        raise ValueError(f"{world_size} processes need --fsdp (01) to keep the model in sync; "
                         f"add --fsdp or --stack 1 or higher")
    sequence_parallel = cfg.ulysses or cfg.untied
    sp = (cfg.sp or world_size) if sequence_parallel else 1
    if cfg.sp is not None and not sequence_parallel:
        raise ValueError("--sp needs --ulysses or --untied")
    ulysses_sp.check_data_sequence_layout(world_size, sp)
    ring = ring_degree(cfg, sp, args) if sequence_parallel else 1
    if sequence_parallel:
        ring_sp.check_ring(sp, ring, cfg.seq_len)
        ulysses_sp.check_ulysses_shapes(args.n_heads, args.n_kv_heads, sp // ring, cfg.seq_len)
    head_chunk = (untied_sp.check_head_chunk(args.n_heads, args.n_kv_heads, sp // ring,
                                             cfg.head_chunk) if cfg.untied else None)
    tiling.check_tile_tokens("mlp_tile_tokens", cfg.mlp_tile_tokens)
    tiling.check_tile_tokens("loss_tile_tokens", cfg.loss_tile_tokens)
    return sp, ring, head_chunk


def ring_degree(cfg: Config, sp: int, args) -> int:
    """06's ring degree R for `sp` sequence-parallel ranks: --ring, else 1 when Ulysses can use
    all of them, else the smallest R (dividing P) that lets the heads split over P/R ranks:
    5 query heads on P = 4 ranks: R = 4; 32 on P = 64: R = 2."""
    if cfg.ring is not None or not (cfg.ulysses or cfg.untied):
        return cfg.ring or 1
    for ring in (r for r in range(1, sp + 1) if sp % r == 0):
        try:
            ulysses_sp.check_ulysses_shapes(args.n_heads, args.n_kv_heads, sp // ring)
            if cfg.untied:
                untied_sp.check_head_chunk(args.n_heads, args.n_kv_heads, sp // ring,
                                           cfg.head_chunk)
        except ValueError:
            continue
        return ring
    return 1  # none works: check_layout names why with R = 1
