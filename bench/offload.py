"""Checkpointing and offload (03) on Llama-3-8B shapes, FSDP2 + Ulysses over the GPUs: peak GPU
memory and step time without checkpointing, with it, and with the checkpoints offloaded.

    torchrun --nproc-per-node 2 -m bench.offload                   # 2 H200s, about 7-8 minutes
    torchrun --nproc-per-node 2 -m bench.offload --parts layers overhead
    torchrun --nproc-per-node 2 -m bench.offload --device cpu --model tiny --fits-seq-len 256 \\
        --layers-seq-len 256 --overhead-seq-len 512 --long-seq-len 512 --long-layers 8   # smoke test

Every configuration builds the model through train.py (resolve_techniques, setup_runtime,
build_model with a `<preset>-<N>L` preset of fewer layers, make_optimizer) and runs
train.train_step; AdamW's moments are created before the first measured step (a zero-gradient
step at learning rate 0), so every step already holds the whole model state. Peak = the largest
torch.cuda.max_memory_allocated of a step, over the ranks (model state included); step time =
median wall time of the steps after the first (the only one when there is one); "above state" =
peak minus the model state (parameters, Adam's moments, gradients), which grows with the layers
by itself (1.6 GiB per Llama-3-8B layer over 2 GPUs). "OOM" where a
configuration did not fit. The loss is tiled (04) in every row when 04_alst_tiling.py is built:
untiled logits (local tokens x 128,256 x 4 bytes, several times) would not fit at any of these
lengths and would hide what 03 changes. The MLP is not tiled.

Parts (--parts):
  fits      --fits-seq-len (32K), --layers (8) layers: none / checkpoint / offload all fit.
  layers    --layers-seq-len (128K), 4 and 8 layers: above the model state, checkpoint grows by 4
            block inputs, offload stays flat (target: grows < 1 GiB from 4 to 8 layers).
  overhead  --overhead-seq-len (256K), --overhead-layers (4): checkpoint vs offload step time
            (target: offload adds <= 3%), with the bytes copied per step and the time those copies
            would take at the measured pinned-copy bandwidth if they did not overlap compute.
  long      --long-seq-len (384K) at full depth (--long-layers 32), one step: only offload fits.
            With fewer layers, the block inputs (8 KiB per token per layer) are smaller than one
            block's recompute (~250 KiB per token with an untiled MLP), so dropping them cannot
            decide whether a step fits; at 32 layers they are as large as the recompute.
            (The longest part: about 4 minutes, most of it the one offload step.)
Nothing starts after --budget-s (460) seconds; the JSON is rewritten after every configuration,
so a run cut short keeps what it measured.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from functools import partial

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import torch
import torch.distributed as dist

from support import kernels
import model as llama
from bench.report import (
    cuda_time_ms,
    default_out_dir,
    end_distributed,
    refuse_without_gpu,
    release,
    synchronize,
    within_budget,
    write_result,
)
from bench.step import with_layers
from support.data import parse_tokens
from support.demos import gradient_bytes

train = importlib.import_module("train")
ulysses = importlib.import_module("02_ulysses")
GiB = 2**30
MODES = {"none": (False, False), "checkpoint": (True, False), "offload": (True, True)}


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


def max_over_ranks(value: float, rt) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=rt.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run_config(base_cfg, rt, part: str, seq_len: int, layers: int, mode: str, steps: int) -> dict:
    checkpointing, offloading = MODES[mode]
    cfg = train.resolve_techniques(dataclasses.replace(
        base_cfg, model=with_layers(base_cfg.model, layers), seq_len=seq_len,
        checkpoint=checkpointing, offload=offloading))
    row = {"part": part, "seq_len": seq_len, "local_tokens": seq_len // rt.sp, "layers": layers,
           "mode": mode}
    model = optimizer = None
    try:
        model = train.build_model(cfg, rt)
        optimizer = train.make_optimizer(model, cfg)
        allocate_adam_state(model, optimizer)
        vocab = llama.get_model_args(cfg.model).vocab_size
        tokens = torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
        times, peaks, above_state = [], [], []
        for step in range(steps):
            synchronize(rt.device)
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                # Parameters and Adam's moments now; gradients (as large as the parameter
                # shards) come during backward. All grow with the layers.
                model_state = torch.cuda.memory_allocated() + gradient_bytes(model)
            start = time.perf_counter()
            train.train_step(model, optimizer, tokens, rt, cfg, step=step)
            synchronize(rt.device)
            times.append(time.perf_counter() - start)
            if rt.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated()
                peaks.append(max_over_ranks(peak / GiB, rt))
                above_state.append(max_over_ranks((peak - model_state) / GiB, rt))
        row.update(status="ok", step_times_s=times, step_time_s=statistics.median(times[1:] or times),
                   peak_gib=max(peaks) if peaks else None,
                   peak_above_model_state_gib=max(above_state) if above_state else None,
                   peak_gib_per_step=peaks)
        if offloading:
            offloader = model.checkpoint_offload
            stats = {k: v for k, v in offloader.stats.items() if k != "events"}
            buffers = offloader.host_buffers
            row.update(host_gib=buffers.nbytes / GiB, host_allocations=buffers.allocations,
                       offload_stats_last_step=stats)
            if rt.device.type == "cuda" and hasattr(torch.cuda, "host_memory_stats"):
                # What the pinned allocator really holds (it rounds buffers up to powers of two).
                host = torch.cuda.host_memory_stats()
                row["pinned_allocator_gib"] = {k: v / GiB for k, v in host.items()
                                               if k.startswith("allocated_bytes")}
    except torch.OutOfMemoryError as error:  # train.StepOutOfMemory is one
        row.update(status="OOM", error=str(error).split("\n")[0][:300])
    del model, optimizer
    release(rt.device)
    dist.barrier()
    return row


def pinned_copy_gbps(device, nbytes: int = GiB) -> dict:
    """Host<->device bandwidth of pinned memory, GB/s (what the offload copies run at)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = cuda_time_ms(lambda: host.copy_(gpu, non_blocking=True))
    h2d = cuda_time_ms(lambda: gpu.copy_(host, non_blocking=True))
    return {"d2h_gbps": nbytes / d2h / 1e6, "h2d_gbps": nbytes / h2d / 1e6}


def summarize(rows: list[dict], bandwidth: dict | None, opts) -> dict:
    ok = {(r["part"], r["layers"], r["mode"]): r for r in rows if r.get("status") == "ok"}
    summary = {}
    peaks = {(layers, mode): ok[("layers", layers, mode)]["peak_above_model_state_gib"]
             for layers in (4, 8) for mode in ("checkpoint", "offload") if ("layers", layers, mode) in ok}
    for mode in ("checkpoint", "offload"):
        if (4, mode) in peaks and (8, mode) in peaks and peaks[(4, mode)] is not None:
            summary[f"{mode}_peak_above_model_state_growth_4_to_8_layers_gib"] = peaks[(8, mode)] - peaks[(4, mode)]
    summary["target_offload_peak_growth_4_to_8_layers_gib"] = ("< 1 (peak above the model state: "
                                                               "parameters, gradients, Adam)")
    ck = ok.get(("overhead", opts.overhead_layers, "checkpoint"))
    off = ok.get(("overhead", opts.overhead_layers, "offload"))
    if ck and off:
        summary["offload_step_time_overhead"] = off["step_time_s"] / ck["step_time_s"] - 1
        stats = off.get("offload_stats_last_step")
        if stats and bandwidth:
            serial = (stats["offloaded_bytes"] / (bandwidth["d2h_gbps"] * 1e9)
                      + stats["restored_bytes"] / (bandwidth["h2d_gbps"] * 1e9))
            summary["offload_copy_bytes_per_step_gib"] = (stats["offloaded_bytes"] + stats["restored_bytes"]) / GiB
            summary["offload_copy_time_if_not_overlapped_s"] = serial
            summary["offload_added_time_s"] = off["step_time_s"] - ck["step_time_s"]
    summary["target_offload_step_time_overhead"] = "<= 0.03 at >= 256K tokens per step"
    summary["long"] = {r["mode"]: r["status"] for r in rows if r["part"] == "long"}
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--parts", nargs="+", default=["fits", "layers", "overhead", "long"],
                        choices=["fits", "layers", "overhead", "long"])
    parser.add_argument("--layers", type=int, default=8, help="depth for the 'fits' part")
    parser.add_argument("--fits-seq-len", default="32K")
    parser.add_argument("--layers-seq-len", default="128K")
    parser.add_argument("--overhead-seq-len", default="256K")
    parser.add_argument("--overhead-layers", type=int, default=4)
    parser.add_argument("--long-seq-len", default="384K")
    parser.add_argument("--long-layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration (first = warm-up)")
    parser.add_argument("--no-tile-loss", action="store_true", help="keep the loss untiled")
    parser.add_argument("--budget-s", type=float, default=460, help="skip what starts after this")
    parser.add_argument("--out", default=None, help="directory (default $OUT or docs/results)")
    opts = parser.parse_args()
    refuse_without_gpu("offload.py", opts.model, opts.device,
                       "torchrun --nproc-per-node 2 -m bench.offload --device cpu --model tiny "
                       "--fits-seq-len 256 --layers-seq-len 256 --overhead-seq-len 512 --long-seq-len "
                       "512 --long-layers 8")
    started = time.perf_counter()
    if "WORLD_SIZE" in os.environ:  # the JSON records the command as it was launched
        os.environ.setdefault("BENCH_COMMAND", f"torchrun --nproc-per-node {os.environ['WORLD_SIZE']} "
                                               f"-m bench.offload {' '.join(sys.argv[1:])}".strip())

    if not dist.is_initialized() and "WORLD_SIZE" in os.environ:
        # A bounded collective timeout: if an out-of-memory error ever left the ranks out of
        # step, the run ends instead of hanging (the results so far are already written).
        if opts.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if opts.device == "cuda" else "gloo", timeout=timedelta(seconds=300))
    tile_loss = importlib.util.find_spec("04_alst_tiling") is not None and not opts.no_tile_loss
    base_cfg = train.resolve_techniques(train.Config(
        model=opts.model, device=opts.device, dtype="bfloat16" if opts.device == "cuda" else "float32",
        fsdp=True, ulysses=True, tile_loss=tile_loss, steps=0,
        seq_len=parse_tokens(opts.fits_seq_len)))
    rt = train.setup_runtime(base_cfg)
    args = llama.get_model_args(opts.model)
    on_gpu = rt.device.type == "cuda"
    bandwidth = pinned_copy_gbps(rt.device) if on_gpu else None
    result = {"what": "activation checkpointing and checkpoint offload (03_checkpoint_offload.py)",
              "model": opts.model, "dtype": base_cfg.dtype, "sp": rt.sp, "world_size": rt.world,
              "stack": "fsdp + ulysses" + (" + tiled loss (04)" if tile_loss else "") + " + none/checkpoint/offload",
              "layers_note": f"{opts.model} width with fewer layers than its {args.n_layers} where "
                             f"stated in each row ('layers'); the long part uses {opts.long_layers}",
              "peak_note": "max over ranks of torch.cuda.max_memory_allocated per step, model state "
                           "(with AdamW moments) included",
              "gpu_memory_gib": (torch.cuda.get_device_properties(rt.device).total_memory / GiB
                                 if on_gpu else None),
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "attention_kernel": kernels.attention_kernel_name(rt.device, getattr(torch, base_cfg.dtype)),
              "pinned_copy": bandwidth, "rows": [], "summary": {}}
    out_dir = opts.out or default_out_dir()
    name = f"offload_{opts.model}_{rt.world}gpu" if on_gpu else f"offload_{opts.model}_cpu"

    in_budget = partial(within_budget, started, opts.budget_s, rt.device)

    def save():  # after every configuration, so a run cut short still leaves its numbers
        result["summary"] = summarize(result["rows"], bandwidth, opts)
        result["wall_s"] = time.perf_counter() - started
        if rt.rank == 0:
            write_result(name, result, out_dir, announce=False)

    parse = parse_tokens
    plan = {  # part -> [(seq_len, layers, mode, steps)]
        "fits": [(parse(opts.fits_seq_len), opts.layers, m, opts.steps) for m in MODES],
        "layers": [(parse(opts.layers_seq_len), n, m, 2) for n in (4, 8) for m in ("checkpoint", "offload")],
        "overhead": [(parse(opts.overhead_seq_len), opts.overhead_layers, m, opts.steps)
                     for m in ("checkpoint", "offload")],
        # Offload first, on a clean allocator: it is the one expected to fit.
        "long": [(parse(opts.long_seq_len), opts.long_layers, m, 1) for m in ("offload", "checkpoint", "none")],
    }
    for part in opts.parts:
        for seq_len, layers, mode, steps in plan[part]:
            if not in_budget():
                row = {"part": part, "seq_len": seq_len, "layers": layers, "mode": mode,
                       "status": "skipped (time budget)"}
            else:
                row = run_config(base_cfg, rt, part, seq_len, layers, mode, steps)
            result["rows"].append(row)
            if rt.rank == 0:
                print({k: v for k, v in row.items() if k not in ("peak_gib_per_step",)}, flush=True)
            save()

    if rt.rank == 0:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"\n{opts.model}, FSDP + Ulysses over {rt.world} rank{'s' if rt.world > 1 else ''}{', tiled loss' if tile_loss else ''}; "
              f"peak includes the model state")
        print(f"{'part':>9} {'tokens':>8} {'layers':>6} {'mode':>11} {'peak GiB':>9} "
              f"{'above state':>12} {'step s':>8} {'host GiB':>9}")
        for r in result["rows"]:
            ok = r["status"] == "ok"
            print(f"{r['part']:>9} {r['seq_len']:>8,} {r['layers']:>6} {r['mode']:>11} "
                  f"{fmt(r.get('peak_gib'), '.2f') if ok else r['status']:>9} "
                  f"{fmt(r.get('peak_above_model_state_gib'), '.2f'):>12} "
                  f"{fmt(r.get('step_time_s'), '.3f') if ok else '':>8} {fmt(r.get('host_gib'), '.2f'):>9}")
        print(json.dumps(result["summary"], indent=1))
        print(f"wall {time.perf_counter() - started:.0f} s")
    end_distributed()


if __name__ == "__main__":
    main()
