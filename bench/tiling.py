"""Tiled MLP and tiled loss (04) on Llama-3-8B shapes: peak memory and time of each phase,
untiled vs tiled, and the step-time overhead of tiling.

    torchrun --nproc-per-node 2 -m bench.tiling                  # 2 H200s, about 5 minutes
    python -m bench.tiling --device cpu --model tiny --seq-lens 2K --step-seq-lens 256 --repeats 1

Phases, measured directly on each GPU's local tokens (total / GPUs, what Ulysses leaves it):
  - MLP: one block's MLP forward + backward on (local tokens, 4096) bf16;
  - loss: final norm + lm_head + cross-entropy forward + backward on the same;
peak = torch.cuda.max_memory_allocated during the phase minus what was allocated before it (the
input, the weights), time = median of --repeats after one warm-up. "OOM" where it did not fit.
Steps: train.py's forward_backward (no optimizer step) with FSDP2 + Ulysses (+ checkpointing
when 03_checkpoint_offload.py exists) on a --layers-deep model of Llama-3-8B width, untiled,
with only the loss tiled, and with both tiled: the overhead of tiling where both fit (target
at most 5%). Fewer layers than 32 are stated in the JSON. The loss runs once per step and the
MLP once per layer, so a shallow model overstates the loss's share: an untiled 1-layer step
gives the time per layer, and the overhead is also extrapolated to the full depth:
    (extra time of loss tiling + 32 x extra time of MLP tiling per layer) / full-depth step time.
"""

import argparse
import dataclasses
import importlib
import importlib.util
import time
from functools import partial

import torch
import torch.distributed as dist

from support import kernels
import model as llama
from bench.report import (default_out_dir, end_distributed, peak_and_times, refuse_without_gpu,
                          release, within_budget, write_result)
from bench.step import with_layers
from support.data import parse_tokens

train = importlib.import_module("train")
tiling = importlib.import_module("04_alst_tiling")
ulysses = importlib.import_module("02_ulysses")
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Phases: one MLP, and norm + lm_head + loss, on one GPU's local tokens.
# ---------------------------------------------------------------------------------------------

def measure_phases(args, local_tokens: int, device, dtype, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    with torch.device(device):  # one block (for its MLP), the final norm and lm_head
        model = llama.Transformer(dataclasses.replace(args, n_layers=1)).to(dtype)
        x = torch.randn(1, local_tokens, args.dim, dtype=dtype).requires_grad_()
        labels = torch.randint(0, args.vocab_size, (1, local_tokens))
    mlp = model.layers[0].mlp
    mlp_tile = tiling.mlp_tile_size(args.dim, local_tokens)
    loss_tile = tiling.loss_tile_size(args.vocab_size, local_tokens)
    phases = [  # (phase, tile tokens or None, function of x)
        ("mlp", None, lambda x: llama.MLP.forward(mlp, x).sum()),
        ("mlp", mlp_tile, lambda x: tiling.tiled_mlp_forward(mlp, x, mlp_tile).sum()),
        ("loss", None, lambda x: llama.Transformer.loss_sum(model, x, labels)),
        ("loss", loss_tile, lambda x: tiling.tiled_loss_sum(model, x, labels, loss_tile)),
    ]
    rows = []
    for phase, tile, fn in phases:
        def run():
            x.grad = None
            model.zero_grad(set_to_none=True)
            fn(x).backward()

        row = {"phase": phase, "local_tokens": local_tokens, "tiled": tile is not None,
               "tile_tokens": tile, "tiles": tiling.tile_count(local_tokens, tile) if tile else 1}
        try:
            row.update(status="ok", **peak_and_times(run, device, repeats))
        except torch.OutOfMemoryError as error:  # train.StepOutOfMemory is one
            row.update(status="OOM", error=str(error).split("\n")[0])
        x.grad = None
        model.zero_grad(set_to_none=True)
        release(device)
        rows.append(row)
    del model, x, labels
    release(device)
    return rows


# ---------------------------------------------------------------------------------------------
# Steps: train.py's forward + backward with FSDP + Ulysses, untiled vs tiled.
# ---------------------------------------------------------------------------------------------

VARIANTS = {"untiled": (False, False), "loss tiled": (False, True), "mlp+loss tiled": (True, True)}


def measure_step(base_cfg, rt, seq_len: int, variant: str, layers: int, repeats: int) -> dict:
    tile_mlp, tile_loss = VARIANTS[variant]
    model_name = with_layers(base_cfg.model, layers)
    cfg = dataclasses.replace(base_cfg, model=model_name, seq_len=seq_len, tile_mlp=tile_mlp,
                              tile_loss=tile_loss)
    row = {"seq_len": seq_len, "variant": variant, "layers": layers}
    model = None
    try:
        model = train.build_model(cfg, rt)
        vocab = llama.get_model_args(cfg.model).vocab_size
        tokens = torch.randint(0, vocab, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))

        def run():
            train.forward_backward(model, tokens, rt)
            model.zero_grad(set_to_none=True)

        row.update(status="ok", **peak_and_times(run, rt.device, repeats))
        row["peak_gib_note"] = "above the model's own memory"
    except torch.OutOfMemoryError as error:  # train.StepOutOfMemory is one
        row.update(status="OOM", error=str(error).split("\n")[0])
    del model
    release(rt.device)
    dist.barrier()
    return row


def overheads(step_rows: list[dict], layers: int, full_layers: int) -> list[dict]:
    """Per length, where both sides ran: time(loss tiled) / time(untiled) - 1, time(both) /
    time(loss tiled) - 1, time(both) / time(untiled) - 1 at `layers`, and the last one
    extrapolated to `full_layers` (see the module docstring)."""
    by_len = {}
    for row in step_rows:
        if row.get("status") == "ok":
            by_len.setdefault(row["seq_len"], {})[(row["variant"], row["layers"])] = row["time_s"]
    out = []
    for seq_len, t in sorted(by_len.items()):
        u, lo, both, u1 = (t.get((v, n)) for v, n in [("untiled", layers), ("loss tiled", layers),
                                                      ("mlp+loss tiled", layers), ("untiled", 1)])
        ratio = lambda a, b: None if a is None or b is None else a / b - 1  # noqa: E731
        full = None
        if None not in (u, lo, both, u1) and layers > 1:
            per_layer = (u - u1) / (layers - 1)
            full_untiled = u + (full_layers - layers) * per_layer
            full = ((lo - u) + full_layers * (both - lo) / layers) / full_untiled
        out.append({"seq_len": seq_len, "layers": layers,
                    "loss_tiling_overhead": ratio(lo, u),
                    "mlp_tiling_overhead": ratio(both, lo),
                    "total_tiling_overhead": ratio(both, u),
                    f"total_tiling_overhead_extrapolated_to_{full_layers}_layers": full,
                    "target": "<= 0.05"})
    return out


# ---------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", nargs="*", default=["512K", "1M"], help="total tokens, phases (none: steps only)")
    parser.add_argument("--step-seq-lens", nargs="+", default=["64K", "128K"],
                        help="total tokens, steps (untiled steps need the whole logits to fit)")
    parser.add_argument("--layers", type=int, default=8, help="model depth for the steps")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after one warm-up")
    parser.add_argument("--budget-s", type=float, default=450, help="skip what starts after this")
    parser.add_argument("--out", default=None, help="directory (default $OUT or docs/results)")
    opts = parser.parse_args()
    refuse_without_gpu("tiling.py", opts.model, opts.device,
                       "python -m bench.tiling --device cpu --model tiny --seq-lens 2K --step-seq-lens "
                       "256 --repeats 1")
    started = time.perf_counter()

    checkpoint = importlib.util.find_spec("03_checkpoint_offload") is not None
    base_cfg = train.resolve_techniques(train.Config(
        model=opts.model, device=opts.device,
        dtype="bfloat16" if opts.device == "cuda" else "float32", fsdp=True, ulysses=True,
        checkpoint=checkpoint, steps=0, seq_len=parse_tokens(opts.step_seq_lens[0])))
    rt = train.setup_runtime(base_cfg)  # joins torchrun's group (or a group of one)
    dtype = getattr(torch, base_cfg.dtype)
    args = llama.get_model_args(opts.model)
    result = {"what": "tiled MLP and tiled loss (04_alst_tiling.py): phases and steps",
              "model": opts.model, "dtype": base_cfg.dtype, "sp": rt.sp,
              "step_layers": opts.layers, "step_layers_note": f"steps use {opts.layers} of "
              f"{args.n_layers} layers (same width), plus an untiled 1-layer step for the time per "
              f"layer; phases are one MLP and the loss",
              "step_stack": "fsdp + ulysses" + (" + checkpoint" if checkpoint else ""),
              "step_what": "train.forward_backward, no optimizer step",
              "mlp_tile_rule": "ceil(local / dim) equal tiles", "loss_tile_rule": "<= 1 GiB fp32 logits",
              "attention_kernel": kernels.attention_kernel_name(rt.device, dtype),
              "phases": [], "steps": [], "overheads": []}
    out_dir = opts.out or default_out_dir()
    name = f"tiling_{opts.model}_{rt.world}gpu" if opts.device == "cuda" else f"tiling_{opts.model}_cpu"

    in_budget = partial(within_budget, started, opts.budget_s, rt.device)

    def save():  # after every configuration, so a run cut short still leaves its numbers
        if rt.rank == 0:
            write_result(name, result, out_dir, announce=False)

    for text in opts.seq_lens:
        seq_len = parse_tokens(text)
        if not in_budget():
            result["phases"].append({"seq_len": seq_len, "status": "skipped (time budget)"})
            continue
        for row in measure_phases(args, seq_len // rt.sp, rt.device, dtype, opts.repeats):
            result["phases"].append({"seq_len": seq_len, **row})
            if rt.rank == 0:
                print(result["phases"][-1], flush=True)
        dist.barrier()
        save()

    for text in opts.step_seq_lens:
        seq_len = parse_tokens(text)
        for variant, layers in [*((v, opts.layers) for v in VARIANTS), ("untiled", 1)]:
            if not in_budget():
                result["steps"].append({"seq_len": seq_len, "variant": variant, "layers": layers,
                                        "status": "skipped (time budget)"})
                continue
            result["steps"].append(measure_step(base_cfg, rt, seq_len, variant, layers, opts.repeats))
            if rt.rank == 0:
                print(result["steps"][-1], flush=True)
            save()
    result["overheads"] = overheads(result["steps"], opts.layers, args.n_layers)
    result["wall_s"] = time.perf_counter() - started

    if rt.rank == 0:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"\n{'total':>8} {'local':>8} {'phase':>5} {'tiles':>6} {'peak GiB':>9} {'time s':>8}")
        for r in result["phases"]:
            if "phase" in r:
                peak = fmt(r.get("peak_gib"), ".2f") if r["status"] == "ok" else r["status"]
                print(f"{r['seq_len']:>8} {r['local_tokens']:>8} {r['phase']:>5} {r['tiles']:>6} "
                      f"{peak:>9} {fmt(r.get('time_s'), '.3f'):>8}")
        print(f"\n{'total':>8} {'layers':>6} {'variant':>15} {'step s':>8} {'peak GiB':>9}")
        for r in result["steps"]:
            time_s = fmt(r.get("time_s"), ".3f") if r["status"] == "ok" else r["status"]
            print(f"{r['seq_len']:>8} {r['layers']:>6} {r['variant']:>15} {time_s:>8} "
                  f"{fmt(r.get('peak_gib'), '.2f'):>9}")
        for o in result["overheads"]:
            full = o[f"total_tiling_overhead_extrapolated_to_{args.n_layers}_layers"]
            print(f"{o['seq_len']:>8} overhead at {o['layers']} layers: loss tiling "
                  f"{fmt(o['loss_tiling_overhead'], '+.1%')}, MLP tiling {fmt(o['mlp_tiling_overhead'], '+.1%')}, "
                  f"both {fmt(o['total_tiling_overhead'], '+.1%')}; both at {args.n_layers} layers "
                  f"(extrapolated) {fmt(full, '+.1%')} (target <= +5%)")
        write_result(name, result, out_dir)
    end_distributed()


if __name__ == "__main__":
    main()
