"""What fills a GPU at its peak, read from PyTorch's memory snapshot.

    torchrun --nproc-per-node 2 -m bench.step --snapshot --name s -- \
        --model llama3-8b --seq-len 64K --stack 4

bench/step.py --snapshot records the CUDA caching allocator's history from before the model is
built (`torch.cuda.memory._record_memory_history`), takes `torch.cuda.memory._snapshot()` after
its steps (or at an out-of-memory error) and calls `summarize` here, which replays every
allocation and free of the trace to find the moment with the most bytes allocated and reports
what was alive then:
  - model state: allocations made before the first step began (parameters, and Adam's moments
    when they existed), and those made by optimizer code or FSDP's gradient reduce-scatter;
  - attention: allocations made inside the attention functions of model.py, 02 and 05, and
    (backward runs in autograd's C++ threads, without Python frames) by attention kernels;
  - other: everything else, listed by the innermost function of this repository that
    allocated it (file:function), largest first.
Not every large buffer is alive at the peak, so it also lists, over the whole of the steps, each
owner's largest single allocation: how a temporary spanning the whole local sequence that need
not exist is found, wherever in the step it happens.
On out of memory the trace ends with the request that failed: its size and owner are reported
with what was alive at that moment ("what OOMs", as the chart shows it).
The replayed peak is recorded next to torch.cuda.max_memory_allocated as a check: they differ
by the allocator's rounding (the trace records requested sizes) and by nothing else unless the
trace outgrew max_entries (then "trace_complete" is false and nothing is attributed by time).
The raw snapshot can also be dumped and viewed offline: python -m torch.cuda._memory_viz, or
drag the pickle into https://pytorch.org/memory_viz.
"""

from functools import lru_cache
from pathlib import Path

GiB = 2**30
REPO = Path(__file__).resolve().parents[1]
REPO_FILES = {p.name for p in REPO.glob("*.py")}
ATTENTION_FUNCTIONS = {"causal_attention", "sdpa_attention", "attend", "project_qkv", "apply_rope",
                       "rotary", "rotate",
                       "core", "ulysses_attention", "all_to_all", "seq_to_heads", "heads_to_seq"}
ATTENTION_FILES = {"05_untied_ulysses.py"}
ATTENTION_KERNELS = ("scaled_dot_product", "attention_backward", "flash_attn", "fmha")  # C++ frames
MODEL_STATE_MARKS = ("torch/optim/", "foreach_reduce")
STEP_MARK = "step_begins_here"


def start_recording(max_entries: int = 2_000_000) -> None:
    import os

    import torch

    # "all": C++ frames too, so allocations of backward kernels (no Python frames) are named.
    # Naming them with addr2line (the default in older torch) can take minutes per snapshot;
    # dladdr reads only the function names, which is all `owner` and `category` use.
    os.environ.setdefault("TORCH_SYMBOLIZE_MODE", "dladdr")
    # context="alloc": stacks for allocations only. With "all" (also frees), torch 2.11 breaks the
    # tiled steps: checkpoint's early stop raises inside our autograd.Function's forward, and the
    # stack captured for a free during that unwinding loses the exception ("SystemError: apply
    # returned NULL without setting an exception"). Frees need no stack here anyway.
    torch.cuda.memory._record_memory_history(max_entries=max_entries, context="alloc", stacks="all")


def step_begins_here():
    """Leave a mark in the trace (a small allocation made in this function) where a step
    starts; what was allocated before the first mark is model state."""
    import torch

    return torch.empty(1, device="cuda")


@lru_cache(maxsize=None)
def file_name(path: str) -> str:
    """The last part of a frame's file path (cached: a trace repeats a few thousand paths over
    up to millions of frames)."""
    return path.rpartition("/")[2]


def innermost_first(frames: list) -> list:
    """Snapshot frames run from the allocating call outwards; reverse a list that starts at the
    program's entry."""
    if frames and frames[0].get("name") in ("<module>", "_run_module_as_main", "main"):
        return frames[::-1]
    return frames


def owner(frames: list) -> str:
    """file:function of the innermost frame in this repository, else the innermost ATen
    operator (a C++ frame), else the innermost frame."""
    frames = innermost_first(frames)
    for frame in frames:
        name = file_name(frame.get("filename", ""))
        if name in REPO_FILES:
            return f"{name}:{frame.get('name')}"
    for frame in frames:
        if "at::_ops::" in frame.get("name", ""):
            return frame["name"].split("(")[0]
    return f"{file_name(frames[0].get('filename', ''))}:{frames[0].get('name')}" if frames else "?"


def category(frames: list, before_first_step: bool) -> str:
    text = " ".join(f"{f.get('filename', '')}:{f.get('name', '')}" for f in frames)
    if before_first_step or any(mark in text for mark in MODEL_STATE_MARKS):
        return "model state"
    for frame in innermost_first(frames):
        name = file_name(frame.get("filename", ""))
        if name in REPO_FILES:  # the innermost function of ours decides
            if name in ATTENTION_FILES or frame.get("name") in ATTENTION_FUNCTIONS:
                return "attention"
            return "other"
    if any(kernel in frame.get("name", "") for frame in frames for kernel in ATTENTION_KERNELS):
        return "attention"
    return "other"


def replay(trace: list) -> dict:
    """Walk a device's trace: bytes allocated at every moment, the live set at the largest
    one (or at the out-of-memory error, which ends the walk) and where the first step began.
    The live set is rebuilt in a second walk up to that moment (copying it at every new
    maximum would cost the live count at each of them)."""
    live, total = {}, 0
    peak, peak_index = 0, -1
    first_step = None
    oom = None
    largest_in_steps = {}  # owner -> (largest single allocation, its frames, allocations)
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            frames = event.get("frames", [])
            if first_step is None and any(f.get("name") == STEP_MARK for f in frames):
                first_step = index
            if first_step is not None:
                who = owner(frames)
                largest, where, count = largest_in_steps.get(who, (0, frames, 0))
                if event["size"] > largest:
                    largest, where = event["size"], frames
                largest_in_steps[who] = (largest, where, count + 1)
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_index = total, index
        elif action == "free_requested" and event["addr"] in live:  # when the stat drops
            total -= live.pop(event["addr"])
        elif action == "oom":
            oom = {"requested_bytes": event["size"], "owner": owner(event.get("frames", [])),
                   "allocated_bytes": total}
            peak, peak_index = total, index
            break
    at_peak = {}
    for index, event in enumerate(trace[:peak_index + 1]):
        if event.get("action") == "alloc":
            at_peak[event["addr"]] = (event["size"], event.get("frames", []), index)
        elif event.get("action") == "free_requested":
            at_peak.pop(event["addr"], None)
    return {"peak_bytes": peak, "live": list(at_peak.values()), "first_step_index": first_step,
            "oom": oom, "largest_in_steps": largest_in_steps}


def summarize(snapshot: dict, device: int = 0, top: int = 12) -> dict:
    """Bytes alive at the peak by category, the largest owners of 'other' and 'attention', each
    owner's largest allocation during the steps, and on out of memory the failed request (see
    the module docstring)."""
    replayed = replay(snapshot["device_traces"][device])
    first_step = replayed["first_step_index"]
    categories = {"model state": 0, "attention": 0, "other": 0}
    owners = {}
    for size, frames, index in replayed["live"]:
        before = first_step is not None and index < first_step
        kind = category(frames, before)
        categories[kind] += size
        if kind != "model state":
            key = (kind, owner(frames))
            count, nbytes, largest = owners.get(key, (0, 0, 0))
            owners[key] = (count + 1, nbytes + size, max(largest, size))
    largest = sorted(owners.items(), key=lambda item: -item[1][1])[:top]
    summary = {"peak_gib": replayed["peak_bytes"] / GiB,
               "gib": {k: v / GiB for k, v in categories.items()},
               "largest_owners": [{"category": k[0], "owner": k[1], "tensors": c, "gib": b / GiB,
                                   "largest_tensor_gib": m / GiB} for k, (c, b, m) in largest],
               "largest_allocations_in_steps": [
                   {"category": category(frames, False), "owner": who,
                    "largest_tensor_gib": size / GiB, "allocations": count}
                   for who, (size, frames, count) in sorted(
                       replayed["largest_in_steps"].items(), key=lambda item: -item[1][0])[:top]],
               "first_step_found": first_step is not None,
               "trace_complete": first_step is not None}  # the mark falls out of a wrapped trace
    if replayed["oom"]:
        oom = replayed["oom"]
        summary["oom"] = {"requested_gib": oom["requested_bytes"] / GiB, "owner": oom["owner"],
                          "allocated_gib": oom["allocated_bytes"] / GiB}
    return summary
