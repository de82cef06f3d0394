"""The longest sequence whose training step completes, per method, found by search on the GPUs.

    torchrun --nproc-per-node 2 -m bench.max_length --methods ulysses untied
    torchrun --nproc-per-node 2 -m bench.max_length --methods untied --offload-model-state
    torchrun --nproc-per-node 2 -m bench.max_length --methods untied --forward-only   # evaluation
    python -m bench.max_length --device cpu --model tiny --methods ulysses --first-length 1K \\
        --granularity 256 --max-trials 2

Both methods run the whole ALST stack (FSDP2, checkpointing + offload, tiled MLP / loss / norms);
only the attention method differs (Ulysses, or Untied Ulysses with U = P).

Why not the full 32 layers: a full-depth step at 2M tokens on 2 GPUs takes over half an hour, and
its offloaded block inputs (31 x tokens / GPUs x 8 KiB) outgrow the host memory first (251 GiB on
the 2-GPU machine: both stacks stop near 1M there, which says nothing about the GPUs). The GPU
peak of a full-depth step is in the backward of layer 0: the model state, all other layers'
gradients, one block input, and one block's recompute. A --layers 1 model of the same width
reaches the same moment (its only block input stays on the GPU, as layer 0's is brought back),
and a ballast tensor holds what the missing layers would: their parameters, gradients and Adam
moments, sharded (16 bytes x parameters / GPUs); the shallow model's own Adam moments are
created before the measured step, as in any later step. What this leaves out is stated in the JSON:
host memory (reported as what full depth would need) and the missing layers' step time.
With --offload-model-state (01) the model state lives in host memory: the ballast for the
missing layers does too (their parameter and gradient shards pinned, Adam's moments pageable and
written, as FSDP2 and AdamW hold them), and the GPU holds none; the step time then leaves out
the missing layers' host-to-GPU copies and their share of the CPU optimizer step. The GPU peak
then moves: no other layers' gradients wait on the GPU, so the larger moment is the last layer's
backward, which also holds the input of the layer below (brought back from the host ahead of
time). One layer has no layer below: with the state on the host the default depth is 2 layers
(a 3.5M-token trial at 1 layer measured 14 GiB under the full-depth peak the planner gives).

--forward-only: the same search for evaluation's forward (eval.py: under no_grad, without 03's
checkpointing, the ballast holding the missing layers' parameters alone), against the planner's
forward-only count (`plan.py --eval`). Its forward time is one layer's: a full-depth forward is
about layers x that (the embedding and the loss are small next to a layer at these lengths).

Search: the first trial is the planner's longest length for this GPU (train.py --plan, which is
calibrated against these benchmarks), then steps of --step up or down until the status changes,
then bisection to --granularity tokens, within --budget-s (a trial starts only if the time the
last completed one took, scaled by the square of the length, still fits). Every trial is recorded
(length, completed or OOM, time, peak).
"""

import argparse
import dataclasses
import importlib
import time
from functools import partial

import torch
import torch.distributed as dist

from model import get_model_args
import plan as planner
from support import byte_counts
from bench.report import allocate_adam_state
from bench.report import (claim_result, end_distributed, refuse_without_gpu, release, synchronize,
                          within_budget, write_result)
from bench.step import with_layers
from bench.throughput import method_config
from support.data import parse_tokens
from support.progress import attention_kernel
from support.runtime import setup_runtime
from support.config import Config, resolve_techniques

train = importlib.import_module("train")
evaluate = importlib.import_module("eval")
GiB = 2**30


def ballast_bytes(args, layers: int, world: int, on_host: bool = False) -> dict:
    """Per-GPU model state of the layers a `layers`-deep model leaves out, by part: on the GPU
    (FSDP's shards), or with on_host as 01 keeps it in host memory (pinned shards rounded up)."""
    count = byte_counts.offloaded_model_state_bytes if on_host else byte_counts.model_state_bytes
    full = count(args, world)
    shallow = count(dataclasses.replace(args, n_layers=layers), world)
    return {part: full[part] - shallow[part] for part in full}


def allocate_ballast(nbytes: dict, device: torch.device, on_host: bool) -> list:
    """The ballast tensors: one GPU tensor, or on the host the pinned parameter and gradient
    shards and the written (so resident) pageable Adam moments. Nothing on a CPU smoke run,
    nor for no bytes."""
    if device.type != "cuda" or not nbytes:
        return []
    if not on_host:
        return [torch.empty(sum(nbytes.values()), dtype=torch.uint8, device=device)]
    return [torch.empty(nbytes["parameters"] + nbytes.get("gradients", 0), dtype=torch.uint8,
                        pin_memory=True),
            torch.zeros(nbytes.get("optimizer", 0), dtype=torch.uint8)]


def trial(base, method: str, seq_len: int, layers: int, forward_only: bool = False,
          run_step=None, host_ballast: bool = True, ballast_parts=None) -> dict:
    """One optimizer step of a `layers`-deep model plus the ballast: completed or OOM. With
    forward_only, one evaluation forward instead (eval.py's: no checkpointing, no gradients),
    the ballast holding only the missing layers' parameters. run_step(model, optimizer, tokens,
    rt, cfg): the step (default train.train_step; bench/rehearse.py's skips the finite check).
    host_ballast=False: no host ballast with --offload-model-state (the GPU peak needs none).
    ballast_parts: the parts of the missing layers' state allocated before the step (default
    all; bench/rehearse.py's step allocates their gradients when full depth would have them)."""
    started = time.perf_counter()
    args = get_model_args(base.model)
    cfg = method_config(base, method, with_layers(base.model, layers), seq_len)
    if forward_only:
        cfg = evaluate.eval_config(cfg)
    rt = setup_runtime(cfg)
    if cfg.untied and cfg.head_chunk is None:
        cfg.head_chunk = rt.sp  # U = P, the least memory: what this search is about
    row = {"method": method, "seq_len": seq_len, "head_chunk": cfg.head_chunk}
    model = optimizer = ballast = None
    try:
        on_host = cfg.offload_model_state
        missing = ballast_bytes(args, layers, rt.world, on_host)
        if on_host and not host_ballast:
            missing = {}
        if ballast_parts is not None:
            missing = {part: n for part, n in missing.items() if part in ballast_parts}
        if forward_only:  # evaluation holds the parameters alone
            missing = {"parameters": missing["parameters"]} if missing else {}
        ballast = allocate_ballast(missing, rt.device, on_host)
        model = train.build_model(cfg, rt)
        if forward_only and cfg.tile_loss:  # as eval.py builds it
            evaluate.tile_token_scores(model, cfg.loss_tile_tokens)
        tokens = torch.randint(0, args.vocab_size, (1, seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        if forward_only:
            model.eval()
        else:
            optimizer = train.make_optimizer(model, cfg)
            allocate_adam_state(model, optimizer)  # a later step's state, as the ballast holds
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        if forward_only:
            evaluate.token_scores(model, tokens, rt)
        else:
            (run_step or train.train_step)(model, optimizer, tokens, rt, cfg)
        synchronize(rt.device)
        seconds = time.perf_counter() - start
        ballast_gib = sum(t.numel() for t in ballast) / GiB
        row.update({"status": "completed",
                    "forward_time_s" if forward_only else "step_time_s": seconds,
                    "host_ballast_gib" if on_host else "ballast_gib": ballast_gib})
        if rt.device.type == "cuda":
            row["peak_gib"] = torch.cuda.max_memory_allocated() / GiB
    except torch.OutOfMemoryError as error:  # errors.StepOutOfMemory is one
        row.update(status="OOM", error=str(error).split("\n")[0])
    # Full depth would keep n_layers - 1 block inputs in pinned host memory per GPU (training).
    host = (0 if forward_only else
            byte_counts.checkpoint_memory_bytes(args, seq_len, rt.sp, True, 2, pinned=True)["host"])
    if cfg.offload_model_state:  # and its model state
        host += sum(byte_counts.offloaded_model_state_bytes(args, rt.world).values())
    row["full_depth_host_gib_per_gpu"] = host / GiB
    del model, optimizer, ballast
    release(rt.device)
    dist.barrier()
    row["trial_s"] = time.perf_counter() - started  # building, the step, releasing
    return row


def expected_seconds(trials: list, seq_len: int) -> float:
    """A trial's time from the last completed one (any method: the ALST stack is the same),
    scaled by the length squared: attention's quadratic cost dominates."""
    timed = [t for t in trials if t.get("status") == "completed"]
    if not timed:
        return 0.0
    last = timed[-1]
    return last.get("trial_s", last.get("step_time_s", 0.0)) * (seq_len / last["seq_len"]) ** 2


def search(base, method: str, start: int, granularity: int, step: float, layers: int,
           max_trials: int, in_budget, after_trial=lambda fits, fails, trials: None,
           forward_only: bool = False, run_trial=None) -> tuple:
    """(longest completed length or None, shortest OOM length or None, trials): step from
    `start` until the status flips, then bisect to `granularity`. after_trial(fits, fails,
    trials) runs after each trial (the script saves what it has: a trial can take minutes).
    run_trial: what runs one trial, with `trial`'s first five arguments (default `trial`)."""
    rounded = lambda n: max(granularity, n // granularity * granularity)  # noqa: E731
    trials, fits, fails = [], None, None
    length = rounded(start)
    while len(trials) < max_trials and in_budget(length, trials):
        row = (run_trial or trial)(base, method, length, layers, forward_only)
        trials.append(row)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print({k: v for k, v in row.items() if k != "error"}, flush=True)
        if row["status"] == "completed":
            fits = max(fits or 0, length)
        else:
            fails = min(fails or length, length)
        after_trial(fits, fails, trials)
        if fails is None:
            length = max(rounded(int(length * (1 + step))), length + granularity)
        elif fits is None:
            length = min(rounded(int(length / (1 + step))), length - granularity)
            if length < granularity:
                break
        elif fails - fits > granularity:
            length = rounded((fits + fails) // 2)
        else:
            break
    return fits, fails, trials


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--methods", nargs="+", default=["ulysses", "untied"])
    parser.add_argument("--layers", type=int, default=None,
                        help="model depth (default 1; 2 with --offload-model-state: see above)")
    parser.add_argument("--first-length", default=None,
                        help="first length (default: the planner's longest)")
    parser.add_argument("--granularity", default="64K")
    parser.add_argument("--step", type=float, default=0.1, help="relative step before bisecting")
    parser.add_argument("--max-trials", type=int, default=4, help="per method")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--offload-model-state", action="store_true",
                        help="01: the model state (and the missing layers' ballast) in host memory")
    parser.add_argument("--forward-only", action="store_true",
                        help="evaluation's forward (eval.py) instead of a training step")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    if opts.layers is None:
        opts.layers = 2 if opts.offload_model_state else 1
    refuse_without_gpu("max_length.py", opts.model, opts.device,
                       "python -m bench.max_length --device cpu --model tiny --methods ulysses "
                       "--first-length 1K --granularity 256 --max-trials 2")
    started = time.perf_counter()
    parse = parse_tokens
    base = Config(model=opts.model, device=opts.device, steps=1, fsdp=True, checkpoint=True,
                  offload=True, tile_mlp=True, tile_loss=True,
                  offload_model_state=opts.offload_model_state,
                  dtype="bfloat16" if opts.device == "cuda" else "float32")
    rt = setup_runtime(resolve_techniques(dataclasses.replace(base, seq_len=1024)))
    gpu_bytes = (torch.cuda.get_device_properties(rt.device).total_memory
                 if opts.device == "cuda" else 0)

    earlier_trials = []  # of the methods searched before: their times predict the next one's

    def in_budget(length: int, trials: list) -> bool:  # room for the next trial, as rank 0 sees it
        expected = expected_seconds(earlier_trials + trials, length)
        return within_budget(started, opts.budget_s - expected, rt.device)

    depth_note = __doc__.split("Why not the full 32 layers: ")[1].split("\n\n")[0]
    result = {"what": ("longest completed evaluation forward per method (search)"
                       if opts.forward_only
                       else "longest completed training step per method (search)"),
              "model": opts.model, "layers": opts.layers, "depth_note": depth_note,
              "gpu_memory_gib": gpu_bytes / GiB, "offload_model_state": opts.offload_model_state,
              "methods": {},
              "attention_kernel": {}}
    for method in opts.methods:  # the kernel each method's ranks run, for the record
        cfg = method_config(base, method, opts.model, 1024)
        result["attention_kernel"][method] = attention_kernel(
            cfg, setup_runtime(cfg), get_model_args(opts.model))
    name = (f"max_length_{opts.model}_{rt.world}gpu"
            + ("_offload_model_state" if opts.offload_model_state else "")
            + ("_eval" if opts.forward_only else "")
            + ("" if opts.device == "cuda" else "_cpu"))
    claim_result(name, opts.out)  # never over an earlier run's result, on every rank

    def save(method, planned, fits, fails, trials):
        result["methods"][method] = {"planner_longest": planned, "longest_completed": fits,
                                     "shortest_oom": fails, "trials": trials}
        if rt.rank == 0:
            write_result(name, result, opts.out, announce=False)

    for method in opts.methods:
        cfg = method_config(base, method, opts.model, 1024)
        planned = None
        # the planner's longest for this GPU, host memory not limiting (see above)
        if opts.device == "cuda":
            planned, _ = planner.plan_longest_seq_len(
                evaluate.eval_config(cfg) if opts.forward_only else cfg, rt.world, gpu_bytes, 2**60,
                forward_only=opts.forward_only)
        elif not opts.first_length:
            parser.error("--first-length is needed on CPU (the planner plans for a GPU's memory)")
        start = parse(opts.first_length) if opts.first_length else planned
        save(method, planned, None, None, [])  # listed even if the budget allows no trial
        _, _, trials = search(base, method, start, parse(opts.granularity), opts.step, opts.layers,
                              opts.max_trials, in_budget,
                              after_trial=partial(save, method, planned),
                              forward_only=opts.forward_only)
        earlier_trials += trials
    lengths = {m: r["longest_completed"] for m, r in result["methods"].items()}
    if lengths.get("ulysses") and lengths.get("untied"):
        result["untied_over_ulysses"] = lengths["untied"] / lengths["ulysses"]
        result["target"] = ">= 1.25 (paper: 5M vs 4M on 8 x H100)"
    result["wall_s"] = time.perf_counter() - started
    if rt.rank == 0:
        for method, r in result["methods"].items():
            print(f"{method:>8}: longest completed {r['longest_completed']}, "
                  f"shortest OOM {r['shortest_oom']}, {len(r['trials'])} trials")
        write_result(name, result, opts.out)
    end_distributed()


if __name__ == "__main__":
    main()
