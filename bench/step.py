"""Full training steps through train.py's own functions, with a memory breakdown.

    torchrun --nproc-per-node 2 -m bench.step --name fsdp_8b -- \
        --model llama3-8b --seq-len 4K --fsdp

Everything after `--` is train.py's flags. Records per rank 0: bytes allocated after the model is
built (sharded fp32 parameters), after backward (+ gradients), after the first optimizer step
(+ Adam state) = the model state; the peak of each step; step times (median after the first,
which warms up kernels and allocates the optimizer state; with 08/09 after the first two:
bench.report.first_timed_step); tokens/s per GPU; the attention
kernel; the allocator's peak reserved memory and its retries per step (a failed cudaMalloc,
the cache emptied, tried again), and what it holds cached per CUDA stream after each step
(`--release-cache`: given back at each step's end, an A/B against the retries;
`--reduce-scatter-stream-gradients`: FSDP2's own allocation of the gradients, the A/B of
base/gradient_memory.py; `--one-rank-reduce-copied`: on one GPU FSDP2's copy of the reduced
gradients again, the A/B of its in-place reduce; `--one-rank-gather-copied`: on one GPU FSDP2's
gather casts each weight, then copies the cast into its buffer again, the A/B of
base/one_rank_gather.py; `--norm-outputs-kept`: the blocks 03 leaves
unchecked keep their norms' outputs, the A/B of 03's recompute_norms).
`--layers N` overrides the preset's depth (stated in the result). `--snapshot` adds what was
alive at the peak (model state / attention / other, and the largest owners), read from PyTorch's
memory snapshot (bench/snapshot.py); `--snapshot-file` also keeps the raw snapshot.
`--profile` runs one more step under torch.profiler: the ops with the most device time, device
time per kind of kernel, the GPU's idle time between compute kernels and the time with neither
a matmul nor an attention kernel running (bench.report.profile; `--trace FILE`: rank 0's Chrome
trace too); with 08/09 a steady step, one unrecorded step before it, so that its forward runs
the updates that step queued, and its own optimizer step after the record (its updates run in
the next forward): one step's updates in the record.
"""

import argparse
import dataclasses
import importlib
import time
from pathlib import Path

import torch

import plan as planner
from base import kernels
from base.gradient_memory import (gradient_memory_of, gradients_on_the_reduce_scatter_stream,
                                  one_rank_copies, one_rank_reduce_of)
from base.one_rank_gather import cast_then_copy, one_rank_gather_of
from support.config import checkpointed_layers
from support.lessons import checkpointing
from support.runtime import read_machine, setup_runtime
from model import PRESETS, get_model_args
from bench import bound, snapshot
from bench.report import (GpuClocks, cached_by_stream, claim_result, end_distributed,
                          first_timed_step, profile, refuse_without_gpu, steady_step_time,
                          step_done, write_result)
from support.data import TokenData
from support.progress import allocator_retries

train = importlib.import_module("train")
GiB = 2**30


def with_layers(preset: str, layers: int | None) -> str:
    """Register `<preset>-<layers>L` with fewer layers, for runs that cannot afford full depth."""
    if not layers:
        return preset
    name = f"{preset}-{layers}L"
    PRESETS[name] = dataclasses.replace(get_model_args(preset), n_layers=layers)
    return name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True, help="result file name")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--snapshot", action="store_true",
                        help="attribute the peak (memory snapshot)")
    parser.add_argument("--snapshot-file", default=None,
                        help="also dump rank 0's raw snapshot here")
    parser.add_argument("--release-cache", action="store_true",
                        help="torch.cuda.empty_cache() after each step's zero_grad, timed in it: "
                             "the gradients' cached blocks given back where the GPU waits anyway "
                             "(an A/B against the allocator's retries mid-step)")
    parser.add_argument("--reduce-scatter-stream-gradients", action="store_true",
                        help="FSDP2's own allocation of the gradients, on its reduce-scatter "
                             "stream (the A/B of base/gradient_memory.py)")
    parser.add_argument("--norm-outputs-kept", action="store_true",
                        help="the blocks 03 leaves unchecked keep their norms' outputs (the A/B "
                             "of 03's recompute_norms)")
    parser.add_argument("--one-rank-reduce-copied", action="store_true",
                        help="on one GPU, FSDP2's reduce-scatter output a copy of its input again "
                             "(the A/B of base/gradient_memory.py's in-place reduce)")
    parser.add_argument("--one-rank-gather-copied", action="store_true",
                        help="on one GPU, FSDP2's gather casts each weight, then copies the cast "
                             "(the A/B of base/one_rank_gather.py)")
    parser.add_argument("--profile", action="store_true", help="one more step under torch.profiler")
    parser.add_argument("--trace", default=None,
                        help="with --profile: rank 0's Chrome trace file (name.json.gz: gzipped)")
    opts, train_argv = parser.parse_known_args()
    if opts.reduce_scatter_stream_gradients and opts.one_rank_reduce_copied:
        parser.error("--one-rank-reduce-copied is the A/B of the compute stream's reduce-scatter; "
                     "--reduce-scatter-stream-gradients replaces that one: give one of them")
    refuse_without_gpu("step.py")
    train_argv = [a for a in train_argv if a != "--"]
    cfg = train.parse_args(train_argv)
    cfg.model = with_layers(cfg.model, opts.layers)
    # train.py's choices for these flags (the planner's, on this GPU), before the runtime
    cfg = dataclasses.replace(cfg, **planner.plan_run(cfg, read_machine(cfg)).settings)
    rt = setup_runtime(cfg)
    claim_result(opts.name, opts.out)  # never over an earlier run's result, on every rank
    if opts.snapshot or opts.snapshot_file:
        snapshot.start_recording()  # before the model exists: its bytes are in the trace too
    args = get_model_args(cfg.model)
    data = TokenData(cfg, args.vocab_size, rt.dp_rank, rt.dp)
    gib = lambda: torch.cuda.memory_allocated() / GiB  # noqa: E731
    if opts.norm_outputs_kept:  # before the build, which applies 03
        checkpointing.recompute_norms = lambda block: None
    model = train.build_model(cfg, rt)
    if opts.reduce_scatter_stream_gradients:
        gradients_on_the_reduce_scatter_stream(model)
    elif opts.one_rank_reduce_copied:
        one_rank_copies(model)
    if opts.one_rank_gather_copied:
        cast_then_copy(model)
    optimizer = train.make_optimizer(model, cfg)
    memory = {"after_build_gib": gib()}
    times, peaks, reserved, losses, retries, cached = [], [], [], [], [], []
    result = {"what": "train.py steps", "train_args": train_argv, "layers": opts.layers,
              "loss_tiles": bound.LOSS_TILES,
              "release_cache": opts.release_cache,
              "gradient_memory": gradient_memory_of(model),
              "one_rank_reduce": one_rank_reduce_of(model),
              "one_rank_gather": one_rank_gather_of(model),
              "norm_outputs": (None if checkpointed_layers(cfg, args.n_layers) in (0, args.n_layers)
                               else "kept" if opts.norm_outputs_kept else "recomputed"),
              "config": dataclasses.asdict(cfg), "dp": rt.dp, "sp": rt.sp,
              "attention_kernel": kernels.attention_kernel_name(rt.device,
                                                                getattr(torch, cfg.dtype))}
    try:
        # the SM clock and power across the steps (a step's GEMMs beside the same timed alone)
        with GpuClocks.of(rt.device) as clocks:
            for step in range(opts.steps):
                if step == first_timed_step(optimizer):  # the steps the median is taken over
                    clocks.restart()
                if opts.snapshot or opts.snapshot_file:
                    snapshot.step_begins_here()
                step_done(rt.device)  # (08's updates may go on beside the next forward)
                torch.cuda.reset_peak_memory_stats()
                retried = allocator_retries()
                start = time.perf_counter()
                loss = train.forward_backward(model, data.batch(step), rt)
                if step == 0:
                    torch.cuda.synchronize()
                    memory["after_backward_gib"] = gib()
                optimizer.step()
                if step == 0:
                    torch.cuda.synchronize()
                    memory["after_optimizer_step_gib"] = gib()
                optimizer.zero_grad(set_to_none=True)
                if opts.release_cache:
                    torch.cuda.empty_cache()
                step_done(rt.device)
                times.append(time.perf_counter() - start)
                peaks.append(torch.cuda.max_memory_allocated() / GiB)
                reserved.append(torch.cuda.max_memory_reserved() / GiB)  # allocated + cached
                retries.append(allocator_retries() - retried)
                # after zero_grad: the gradients' blocks cached (with 08 still held: each
                # goes in its unit's next forward)
                cached.append(cached_by_stream())
                losses.append(float(loss))
                if rt.rank == 0:
                    print(f"step {step}: loss {losses[-1]:.4f} {times[-1]:.2f}s "
                          f"peak {peaks[-1]:.2f} GiB", flush=True)
        result["gpu_clocks_during_steps"] = clocks.summary
        step_time = steady_step_time(times, optimizer)
        tokens_per_gpu = cfg.batch_size * cfg.seq_len * rt.dp / rt.world
        result.update(status="ok", step_times_s=times, step_time_s=step_time, peak_gib=peaks,
                      reserved_gib=reserved, losses=losses, alloc_retries=retries,
                      cached_by_stream_gib=cached,
                      tokens_per_s_per_gpu=tokens_per_gpu / step_time, **memory)
    except torch.OutOfMemoryError as error:  # errors.StepOutOfMemory is one
        result.update(status="OOM", error=str(error).split("\n")[0], **memory)
    if opts.profile and result.get("status") == "ok":
        def forward_backward():
            train.forward_backward(model, data.batch(opts.steps), rt)

        def optimizer_step():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def one_step():
            forward_backward()
            optimizer_step()

        # with 08/09 a steady step: the recorded forward runs the step before's updates, and
        # the recorded step's own run after the record (a steady step runs them in the next)
        warmup = first_timed_step(optimizer) - 1
        deferred = warmup > 0
        try:  # the profiler's own memory must not turn the measured steps into a failure
            result["profile"] = profile(forward_backward if deferred else one_step, top=25,
                                        trace_path=opts.trace if rt.rank == 0 else None,
                                        warmup=warmup,
                                        between=lambda: step_done(rt.device),
                                        then=optimizer_step if deferred else None)
        except torch.OutOfMemoryError as error:
            result["profile"] = {"status": "OOM", "error": str(error).split("\n")[0]}
    if (opts.snapshot or opts.snapshot_file) and rt.rank == 0:
        started = time.perf_counter()
        taken = torch.cuda.memory._snapshot()
        result["memory_at_peak"] = snapshot.summarize(taken, torch.cuda.current_device())
        result["memory_at_peak"]["snapshot_and_summary_s"] = time.perf_counter() - started
        # The allocator's own maximum over the steps (its peak counter restarts every step).
        result["memory_at_peak"]["max_memory_allocated_gib"] = max(
            peaks + [torch.cuda.max_memory_allocated() / GiB])
        if opts.snapshot_file:
            import pickle

            Path(opts.snapshot_file).write_bytes(pickle.dumps(taken))
    if rt.rank == 0:
        print({k: v for k, v in result.items() if k != "config"})
        write_result(opts.name, result, opts.out)
    end_distributed()


if __name__ == "__main__":
    main()
