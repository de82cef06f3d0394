"""host_memory.py - whether the host can hold what a GPU run offloads to it.

Offloading (03's checkpoints, --keep-attention's outputs, 01's model state) puts hundreds of GiB
in pinned host memory at long lengths; too many and the kernel kills a rank mid-step, after
minutes of work. So training compares the planner's host bytes (plan.py) for this node's ranks
with what the host can still hand out, before it builds anything. Every rank decides from the
least memory any rank sees, so that all of them decide the same.
"""

import os

import torch
import torch.distributed as dist

import plan
from support.config import Config
from support.runtime import Runtime


def check_host_memory(cfg: Config, rt: Runtime) -> None:
    """`host_memory_error` for a GPU run (pinned host buffers; on a CPU they are the activations'
    own memory), with the least memory any rank sees, so that every rank decides the same."""
    if rt.device.type != "cuda" or not (cfg.offload or cfg.offload_model_state):
        return
    available = least_host_memory(rt)
    if available is None:  # unknown somewhere: not refused
        return
    error = host_memory_error(cfg, rt.world, ranks_on_this_node(), available)
    if error:
        raise ValueError(error)


def host_memory_error(cfg: Config, world: int, local_ranks: int,
                      available: int | None) -> str | None:
    """Why the planned host memory of this node's ranks does not fit in `available` bytes, or
    None."""
    if not (cfg.offload or cfg.offload_model_state) or available is None:
        return None
    planned = plan.plan_memory(cfg, world)
    need = planned["host"] * local_ranks
    if need <= available:
        return None
    parts = ", ".join(f"{name} {nbytes / 2**30:.1f}"
                      for name, nbytes in planned["host_parts"].items() if nbytes)
    ranks = f"{local_ranks} rank{'s' if local_ranks > 1 else ''}"
    return (f"the host memory planned for this node's {ranks}, {need / 2**30:.1f} GiB "
            f"({parts} GiB per rank), is more than the {available / 2**30:.1f} GiB available"
            + ("; --keep-attention doubles the offloaded checkpoints: drop it"
               if cfg.keep_attention else "")
            + "; or use more GPUs or a shorter --seq-len (python plan.py with the same flags "
              "shows the plan)")


def least_host_memory(rt: Runtime) -> int | None:
    """The least available host memory any rank sees (None where one does not know it)."""
    available = torch.tensor([available_host_memory() or -1], device=rt.device)
    if dist.is_initialized():
        dist.all_reduce(available, op=dist.ReduceOp.MIN)
    return None if available.item() < 0 else int(available.item())


def ranks_on_this_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def use_this_ranks_cores() -> None:
    """For AdamW on the host (--offload-model-state): torchrun sets OMP_NUM_THREADS=1 per
    process; this rank takes its share of the host's cores instead."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks_here = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(cores // int(ranks_here), 1, torch.get_num_threads()))


def available_host_memory() -> int | None:
    """Bytes the host can still hand out: Linux's MemAvailable, or less where a container's
    memory limit (cgroup v2) leaves less; None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, \
                open("/sys/fs/cgroup/memory.current") as used:
            available = min(available, int(limit.read()) - int(used.read()))
    except (OSError, ValueError):  # no cgroup v2, or "max": no limit
        pass
    return available
