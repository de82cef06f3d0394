"""Shared by the bench scripts: where results go and what every result records.

Every JSON result carries the GPU kind and count, torch version, attention kernel, git commit
and the exact command, so a number in docs/results.md can be traced to the run that produced it.
"""

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from support.lessons import optimizer_overlap


def git(*args: str) -> str | None:
    """A git command's output in this repository (None where git or the repository is absent)."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.rstrip() if done.returncode == 0 else None  # status lines start " M"


def environment() -> dict:
    """Where a result was measured. git_changed_files: the tracked files that differ from
    git_commit (None: none), so a result from an uncommitted tree, or from a copy whose git
    metadata lags its files (as the device machine's copy has), says so by itself."""
    commit, changed = os.environ.get("GIT_COMMIT"), None
    if not commit:
        commit = git("rev-parse", "HEAD") or None
        status = git("status", "--porcelain", "--untracked-files=no")
        paths = [line[3:] for line in (status or "").splitlines()]
        changed = (paths[:20] + [f"and {len(paths) - 20} more"] * (len(paths) > 20)) or None
    gpus = torch.cuda.device_count()
    return {
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpu_count": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "git_commit": commit,
        "git_changed_files": changed,
        "command": (os.environ.get("BENCH_COMMAND")
                    or " ".join([Path(sys.executable).name, *sys.argv])),
        "world_size": int(os.environ.get("WORLD_SIZE", 1)),
    }


def refuse_without_gpu(script: str, model: str | None = None, device=None,
                       cpu_form: str | None = None) -> None:
    """The benchmarks measure GPUs (device: the one asked for, default what torch sees).
    Without one, a full-size model would only exhaust host memory minutes later and be killed
    without a word, and NCCL-only scripts would fail deep inside torch: stop at once and say
    what runs on a CPU instead (the smoke forms tests/test_bench.py runs; their numbers mean
    nothing)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") or model in ("tiny", "small"):
        return
    what = f"--model {model} is a GPU measurement" if model else "it measures GPUs only"
    raise SystemExit(f"bench/{script}: no CUDA GPU here, and {what}. "
                     + (f"Its CPU smoke form: {cpu_form}" if cpu_form else
                        "It has no CPU form; the numbered files' demos run on a CPU."))


def end_distributed() -> None:
    """Tear the process group down once every rank is done: gloo aborts the process ('terminate
    called without an active exception') when a rank destroys its group while its peer is still
    in the last collective, as rank 0 is while it prints and writes the result."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def default_out_dir() -> str:
    return os.environ.get("OUT") or str(Path(__file__).resolve().parents[1] / "docs" / "results")


_written = set()  # the result files this process wrote (saved again after every configuration)


def result_path(name: str, out_dir: str | None = None) -> Path:
    """<out_dir>/<name>.json, where this run may write its result: refused (FileExistsError)
    where an earlier run's result is there."""
    path = Path(out_dir or default_out_dir()) / f"{name}.json"
    if path.exists() and path.resolve() not in _written:
        raise FileExistsError(f"{path} holds an earlier run's result; give this run another "
                              f"--name (or --out), or move that file away")
    return path


def claim_result(name: str, out_dir: str | None = None) -> Path:
    """result_path, asked by a benchmark before it measures anything: on every rank, which then
    wait for each other, so that no rank's first save comes before another rank has asked."""
    path = result_path(name, out_dir)
    if dist.is_initialized():
        dist.barrier()
    return path


def write_result(name: str, result: dict, out_dir: str | None = None,
                 announce: bool = True) -> Path:
    """`result` with environment() as <out_dir>/<name>.json, never over an earlier run's
    (result_path); announce=False for the saves a benchmark makes after every configuration
    (a run cut short keeps what it measured)."""
    path = result_path(name, out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**environment(), **result}, indent=1, default=str) + "\n")
    _written.add(path.resolve())
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


def cached_by_stream() -> dict:
    """GiB the caching allocator holds reserved but unallocated, per CUDA stream ("default" and
    the others by handle): a block freed on one stream is cached for that stream alone, so what
    another stream's cache holds is memory this stream cannot reuse without a retry."""
    default, cached = torch.cuda.current_stream().cuda_stream, {}
    for segment in torch.cuda.memory_snapshot():
        name = "default" if segment["stream"] == default else str(segment["stream"])
        free = (segment["total_size"] - segment["allocated_size"]) / 2**30
        cached[name] = cached.get(name, 0.0) + free
    return cached


def allocate_adam_state(model, optimizer):
    """A step with zero gradients at learning rate 0 creates AdamW's moments without changing
    any weight, so the first measured step already holds the whole model state."""
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr


def cuda_time_ms(fn, warmup: int = 1, repeats: int = 3, inputs: list | None = None,
                 device=None) -> float:
    """Median milliseconds of fn() after warm-up (`event_times_ms`)."""
    return upper_median(event_times_ms(fn, warmup, repeats, inputs, device))


def upper_median(times: list) -> float:
    """The middle of `times` (of an even count, the upper of the two: a time that was run)."""
    return sorted(times)[len(times) // 2]


def event_times_ms(fn, warmup: int = 1, repeats: int = 3, inputs: list | None = None,
                   device=None) -> list:
    """Milliseconds of each of `repeats` calls of fn after `warmup` calls: CUDA events around
    each call (on a CPU device, a host clock). inputs: argument tuples that the calls take in
    turn, so that a call does not find the previous one's operands still in the cache."""
    sets = inputs or [()]
    on_gpu = device is None or torch.device(device).type == "cuda"
    for i in range(warmup):
        fn(*sets[i % len(sets)])
    times = []
    for i in range(warmup, warmup + repeats):
        args = sets[i % len(sets)]
        if not on_gpu:
            start = time.perf_counter()
            fn(*args)
            times.append((time.perf_counter() - start) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_timed_step(optimizer=None) -> int:
    """The first step a timing counts: step 1 (step 0 compiles kernels and allocates memory and
    AdamW's state), or step 2 where the optimizer step runs behind the next forward (08, 09):
    08 runs AdamW's first step at once, so step 1's forward waits for no update and ends sooner
    than every later one (so did 09's while it queued every update at step(), which bench.step
    waited for: Llama-3-8B at 8K on one H100, 0.84 s against 1.9; since 09 queues a block's
    update as the forward nears it, step 1's forward runs step 0's, and the rule is kept)."""
    return 2 if isinstance(optimizer, optimizer_overlap.AdamWBehindForward) else 1


def steady_step_time(times: list, optimizer=None) -> float:
    """The median of the steps from first_timed_step on; with fewer steps, of those after the
    first, or the one."""
    first = first_timed_step(optimizer)
    return statistics.median(times[first:] or times[1:] or times)


def step_done(device):
    """A timed step's end (and the next one's start): the compute stream's work done. A side
    stream may go on (08's updates run beside the next forward, which waits for what it needs);
    every other stream's work a step queues, the compute stream has waited for by then."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class GpuClocks:
    """The GPU's SM clock, power draw and temperature, sampled by nvidia-smi every 100 ms while
    the `with` block runs; `.summary` their medians and extremes (None without nvidia-smi).
    A step's GEMMs ran 10% slower than the same GEMMs timed alone (docs/results.md): under a
    step's sustained power the clocks are one suspect, and this records them beside each."""

    FIELDS = ("clocks.sm", "power.draw", "temperature.gpu")

    def __init__(self, device_index: int | None = 0):
        """device_index: CUDA's number of the GPU; None, not a GPU: nothing sampled, no summary
        (so a run on the CPU takes the same path)."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")  # CUDA's numbering
        if (device_index is not None and device_index < len(visible)
                and visible[device_index].strip().isdigit()):
            device_index = int(visible[device_index])  # as nvidia-smi numbers them
        self.device_index, self.process, self.summary = device_index, None, None

    @classmethod
    def of(cls, device) -> "GpuClocks":
        """The clocks of `device` (a torch.device or its name): its GPU's, or none off a GPU."""
        device = torch.device(device)
        return cls(torch.cuda.current_device() if device.type == "cuda" else None)

    def __enter__(self):
        self.samples = tempfile.TemporaryFile(mode="w+")  # (a pipe could fill in a long step)
        self.kept_from = 0  # the file's offset where the summarized samples begin
        if self.device_index is None:
            return self
        try:
            self.process = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}", "-i",
                 str(self.device_index), "--format=csv,noheader,nounits", "-lms", "100"],
                stdout=self.samples, stderr=subprocess.DEVNULL, text=True)
        except OSError:  # no nvidia-smi here
            self.process = None
        return self

    def restart(self) -> None:
        """Summarize only what is sampled from now on (not a first step's compiles and idle
        waits, which would pull the medians toward an idle GPU's)."""
        self.kept_from = os.fstat(self.samples.fileno()).st_size

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.samples.seek(max(self.kept_from - 1, 0))
            text = self.samples.read()
            if self.kept_from:  # from the first line begun after restart() (one cut: dropped)
                text = text.partition("\n")[2]
            self.summary = clock_summary(text)
        self.samples.close()


def clock_summary(text: str) -> dict | None:
    """nvidia-smi's CSV lines (SM MHz, W, degrees C) as medians and extremes."""
    rows = []
    for line in text.splitlines():
        try:
            rows.append([float(value) for value in line.split(",")])
        except ValueError:  # a line cut by the termination, or "[N/A]"
            continue
    rows = [row for row in rows if len(row) == 3]
    if not rows:
        return None
    sm, watts, celsius = zip(*rows)
    return {"samples": len(rows), "sm_mhz_median": statistics.median(sm), "sm_mhz_min": min(sm),
            "sm_mhz_max": max(sm), "power_w_median": statistics.median(watts),
            "power_w_max": max(watts), "temperature_c_max": max(celsius)}


def release(device):
    """Free what the last configuration left (models hold reference cycles) before the next,
    once every stream's work on it is done (08's updates run on a side stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
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


def profile(fn, top: int = 15, trace_path: str | None = None, warmup: int = 0,
            between=None, then=None) -> dict:
    """Run fn once under torch.profiler: where the time goes. warmup: calls of fn first, each
    followed by `then()` and `between()`, that the profiler sees but does not record (with
    08/09 the recorded step's forward then runs the updates the step before queued, as a
    steady step does; alone, a step's updates run at its end with nothing beside them). The
    recorded call ends when the GPU is done; `then()` runs after it, outside the record: with
    08/09 fn is the forward and backward and then() the optimizer step, whose updates a
    steady step runs in the next forward, so the record holds one step's updates, the step
    before's, beside this forward.

    profile_top_ops: the ops with the most own device time (CPU time on a CPU run), in ms, with
    their call counts. On a GPU, from the device's kernels (`device_kernels`: not the user
    annotations), also device time per kind of kernel (`kernel_classes`);
    `profile_outside_kernels`: the kernels outside matmul and attention with the most device
    time, by name (what a fusion would cut); and `timeline`: the span, the compute kernels' idle
    time in it (launch gaps and waits on communication that no op's own time shows) and the
    time with neither matmul nor attention running.
    trace_path: also write the Chrome trace there (open it in chrome://tracing or Perfetto).
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    schedule = torch.profiler.schedule(wait=0, warmup=warmup, active=1) if warmup else None
    with torch_profile(activities=activities, schedule=schedule) as prof:
        for _ in range(warmup):
            fn()
            if then is not None:
                then()
            if between is not None:
                between()
            prof.step()
        fn()
        if on_gpu:
            torch.cuda.synchronize()
    if then is not None:
        then()

    def own_time(event):  # microseconds; the attribute's name changed across torch versions
        if not on_gpu:
            return event.self_cpu_time_total
        return (getattr(event, "self_device_time_total", None)
                or getattr(event, "self_cuda_time_total", 0))

    events = sorted(prof.key_averages(), key=own_time, reverse=True)[:top]
    result = {"profile_top_ops": [{"op": e.key, "own_ms": own_time(e) / 1e3, "calls": e.count}
                                  for e in events]}
    if on_gpu:
        kernels = device_kernels(prof.events())
        result["profile_kernel_classes_ms"] = kernel_classes((name, end - start)
                                                             for start, end, name in kernels)
        result["profile_outside_kernels"] = outside_kernels((name, end - start)
                                                            for start, end, name in kernels)
        result.update(timeline(kernels))
    if trace_path:
        prof.export_chrome_trace(trace_path)
    return result


def timeline(kernels) -> dict:
    """From (start, end, name) kernels in microseconds: the span from the first kernel's start
    to the last one's end; how much of it the compute kernels (all but NCCL's and the copy
    engines' transfers: offload, memset) left idle; and the time with neither a matmul nor an
    attention kernel running (what the other kernels and the gaps cost; another kernel that
    overlaps them on a side stream costs nothing there)."""
    compute = [(start, end) for start, end, name in kernels
               if not any(key in name.lower() for key in ("nccl", "memcpy", "memset"))]
    if not compute:
        return {}
    span = max(end for _, end, _ in kernels) - min(start for start, _, _ in kernels)
    busy = covered_us(compute)
    working = covered_us([(start, end) for start, end, name in kernels
                          if kernel_class(name) in INSIDE])
    return {"profile_span_ms": span / 1e3, "profile_compute_busy_ms": busy / 1e3,
            "profile_compute_idle_ms": (span - busy) / 1e3,
            "profile_outside_matmul_and_attention_ms": (span - working) / 1e3,
            "profile_kernels": len(kernels)}


def device_kernels(events) -> list[tuple]:
    """(start, end, name) in microseconds of the device's kernels and copies among a profile's
    events. Not the user annotations (record_function ranges such as FSDP's and the optimizer's,
    which the profiler also draws on the GPU's timeline): they span kernels counted already."""
    return [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)]


def covered_us(intervals) -> float:
    """The length of the union of (start, end) intervals."""
    covered, covered_to = 0.0, None
    for start, end in sorted(intervals):
        if covered_to is None or start > covered_to:
            covered, covered_to = covered + end - start, end
        elif end > covered_to:
            covered, covered_to = covered + end - covered_to, end
    return covered


KERNEL_CLASSES = [  # (class, substrings of a kernel's name), the first match wins
    ("attention forward", ("fprop", "flash_fwd", "flashattnfwd", "fmha_fwd", "fmha_cutlassf")),
    ("attention backward", ("bprop", "flash_bwd", "flashattnbwd", "fmha_bwd", "fmha_cutlassb",
                            "fmha_reduce")),
    ("matmul", ("nvjet", "gemm", "cutlass", "splitkreduce")),
    ("communication (nccl)", ("nccl",)),
    ("host copies (03's offload, on its side stream)", ("memcpy htod", "memcpy dtoh")),
    ("copies and casts on the GPU", ("copy", "memcpy", "catarray", "chunk_cat")),
    # fp32 += bf16: the tiles' fp32 weight-gradient sums (04), FSDP's gradients into fp32
    ("mixed-dtype elementwise", ("loadwithcast",)),
    ("softmax (the loss)", ("softmax",)),
]


INSIDE = ("matmul", "attention forward", "attention backward")  # the kernels that do the work


def kernel_class(name: str) -> str:
    """The kind of a kernel, by its name: the first of KERNEL_CLASSES whose substring it holds."""
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_CLASSES if any(key in lowered for key in keys)),
                "other (elementwise, reductions)")


def outside_kernels(kernels, top: int = 40) -> list[dict]:
    """The `top` kernels outside matmul and attention by device time, from (name, microseconds)
    pairs: name (its first 120 characters), class, ms, calls."""
    totals: dict[str, list] = {}
    for name, microseconds in kernels:
        kind = kernel_class(name)
        if kind not in INSIDE:
            entry = totals.setdefault(name[:120], [kind, 0.0, 0])
            entry[1] += microseconds / 1e3
            entry[2] += 1
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"kernel": name, "class": kind, "ms": round(ms, 3), "calls": calls}
            for name, (kind, ms, calls) in ranked]


def kernel_classes(kernels) -> dict:
    """Device milliseconds per kind of kernel from (name, microseconds) pairs: where two
    configurations' step times differ. Also fed from a saved Chrome trace's kernel events."""
    totals = {name: 0.0 for name, _ in KERNEL_CLASSES} | {"other (elementwise, reductions)": 0.0}
    calls = dict.fromkeys(totals, 0)
    for name, microseconds in kernels:
        kind = kernel_class(name)
        totals[kind] += microseconds / 1e3
        calls[kind] += 1
    return {kind: {"ms": round(totals[kind], 3), "calls": calls[kind]} for kind in totals}
