"""Shared by the bench scripts: where results go and what every result records.

Every JSON result carries the GPU kind and count, torch version, attention kernel, git commit
and the exact command, so a number in the README can be traced to the run that produced it.
"""

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def environment() -> dict:
    commit = os.environ.get("GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or None
        except OSError:
            commit = None
    gpus = torch.cuda.device_count()
    return {
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpu_count": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": commit,
        "command": os.environ.get("BENCH_COMMAND") or " ".join([Path(sys.executable).name, *sys.argv]),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
    }


def default_out_dir() -> str:
    return os.environ.get("OUT") or str(Path(__file__).resolve().parents[1] / "docs" / "results")


def write_result(name: str, result: dict, out_dir: str | None = None, announce: bool = True) -> Path:
    """`result` with environment() as <out_dir>/<name>.json; announce=False for the saves a
    benchmark makes after every configuration (a run cut short keeps what it measured)."""
    path = Path(out_dir or default_out_dir()) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**environment(), **result}, indent=1, default=str) + "\n")
    if announce:
        print(f"wrote {path}")
    return path


def within_budget(started: float, budget_s: float, device) -> bool:
    """Whether fewer than budget_s seconds have passed since `started` (time.perf_counter), as
    rank 0 sees it: every rank gets rank 0's answer, so all ranks skip the same configurations
    and their collectives stay matched."""
    flag = torch.tensor([float(time.perf_counter() - started < budget_s)], device=device)
    dist.broadcast(flag, 0)
    return bool(flag.item())


def cuda_time_ms(fn, warmup: int = 1, repeats: int = 3) -> float:
    """Median milliseconds of fn() measured with CUDA events after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device):
    """Free what the last configuration left (models hold reference cycles) before the next."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_and_times(run, device, repeats: int) -> dict:
    """Run once (the warm-up, and the peak memory above what was allocated before it), then time
    `repeats` more runs: median seconds."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    run()
    synchronize(device)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {"peak_gib": peak, "time_s": statistics.median(times) if times else None}
