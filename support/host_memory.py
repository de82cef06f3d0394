"""host_memory.py - the host's memory and cores, as a run sees them.

Offloading (03's checkpoints, --keep-attention's outputs, 01's model state) puts hundreds of GiB
in pinned host memory at long lengths; too many and the kernel kills a rank mid-step, after
minutes of work. So before a GPU run builds anything, the planner (plan.plan_run) compares its
host bytes for this node's ranks with what the host can still hand out, read here
(support/runtime.py's read_machine takes the least any rank sees). With the model state on the
host, AdamW steps there, on this rank's share of the cores. A CPU run plans nothing, but its
model state must fit the host (check_cpu_run_fits).
"""

import os

import torch


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


def check_cpu_run_fits(model_name: str, n_params: int, sharded: bool, dtype: str) -> None:
    """A CPU run keeps everything in this host's memory, where nothing is planned: refuse one
    whose model state alone cannot fit, before it builds the model, rather than meet the
    allocator's error (or the kernel's OOM killer) minutes in. The state: weights, gradients
    and AdamW's two moments, 4 tensors of the parameters' size: fp32 masters under FSDP (16
    bytes a parameter, shared by this host's ranks), else in the run's dtype (one process)."""
    available = available_host_memory()
    per_param = 16 if sharded or dtype == "float32" else 4 * getattr(torch, dtype).itemsize
    if sharded:  # the host holds its own ranks' shards
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        needed = per_param * n_params * int(os.environ.get("LOCAL_WORLD_SIZE", ranks)) // ranks
    else:
        needed = per_param * n_params
    if available is not None and needed > available:
        raise ValueError(f"a CPU run of {model_name} keeps its model state in this host's "
                         f"memory: at least {needed / 2**30:.1f} GiB (weights, gradients and "
                         f"AdamW's moments, {per_param} bytes a parameter), where "
                         f"{available / 2**30:.1f} GiB is available: train a smaller --model on "
                         f"the CPU (tiny, small), or on GPUs")
