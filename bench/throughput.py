"""Throughput of a training step on Llama-3-8B shapes: tokens/s per GPU and MFU for no context
parallelism, PyTorch's own ring attention (the peer, bench/ring.py), Ulysses and Untied Ulysses,
all on the same ALST stack (FSDP2, checkpointing + offload, tiled MLP / loss / norms), measured
side by side in one run; next to each, the bound set by the kernels' own speed.

    torchrun --nproc-per-node 2 -m bench.throughput                          # 2 H200s
    torchrun --nproc-per-node 2 -m bench.throughput --seq-lens 1M --methods ulysses untied ring
    python -m bench.throughput --device cpu --model tiny --seq-lens 1K --methods none ulysses untied
    python -m bench.throughput --plot docs/results/throughput_llama3-8b_2gpu.json \
        docs/results/throughput_llama3-8b_2gpu_1m.json        # the chart from saved results

Depth: a full 32-layer step at 512K tokens on 2 GPUs takes minutes, so each row runs the real
length with 1 and with 2 layers of Llama-3-8B width and extrapolates per layer:
    step(32 layers) = step(1) + 31 x (step(2) - step(1))
(embedding, loss and the optimizer of the big vocabulary are in step(1); every extra layer adds
one offloaded block, as all but the last of the 32 are). Marked "extrapolated" in the JSON;
--validate METHOD:LENGTH also runs that row at full depth to show the extrapolation's error.

Rows (each GPU's tokens per step: S / GPUs, except no context parallelism, where each GPU trains
its own sequence of S tokens):
  none      no context parallelism: FSDP over the GPUs, each GPU attends over its whole sequence;
  ring      torch.distributed.tensor.experimental.context_parallel (load-balanced ring, SDPA);
  ulysses   02_ulysses.py;   untied[:U]   05_untied_ulysses.py with head chunk U (default: what
            train.py takes for the full-depth model, plan.plan_run: the fewest stages
            whose planned step fits the GPU; so is the MLP tile).
  METHOD+host-state   the same with the model state on the host (01's --offload-model-state:
            its extra step time is per layer, so the 1 + 2 layer extrapolation holds for it);
  METHOD+keep-attention   the same with 03's --keep-attention (the recompute runs no attention
            forward; the FLOPs below count one fewer);
  METHOD@KERNEL       with that attention kernel (--attn-kernel), e.g. ulysses+host-state@fa4.
Step = forward + backward + AdamW step; time = the median of --steps after the first (which warms
up kernels, the allocator and the offload buffers), single step above --single-step-above. A 1-
and 2-layer pair measures a layer as their difference, so a step's run-to-run noise (~1%) counts
twice in it: compare methods within a few percent at full depth (--validate; `--seq-lens` with
no lengths runs only those rows).

FLOPs (per step, all GPUs; support/step_time.py's step_flops, the count the speed model uses), what
MFU and the bound count: per layer, causal attention forward 2 S^2 d (d = heads x head dim),
backward 2.5x forward, checkpoint recompute one more forward; linear layers 2 x params x tokens
forward, 2x that backward, recompute one more forward (not down_proj's, which no recompute needs;
the tiled loss runs lm_head once: its tiles' backward runs in forward). MFU = FLOPs / (time x GPUs
x 989 TFLOP/s, the H200's dense bf16 peak). Kernel bound (bench/bound.py, measured on this GPU in
this run): one GPU's attention FLOPs at the attention kernel's rate at its best at that length (all
heads in one call over all S tokens; measured once per length and kernel), plus the step's own
GEMMs on one GPU, each timed at its shape and tile (q/k/v/o, gate/up/down over 04's MLP tiles,
lm_head over its loss tiles; forward, recompute and both backward products). A step faster than its
bound stops the run with an error naming the term that is wrong. --rows-from: no steps, the rows of
an earlier result against the bound measured now (its step times, this GPU's kernels); --recount:
no GPU, its bound from its own measured times, the GEMMs counted as they are now; --bound-of:
no steps, full-depth steps measured elsewhere (bench.step's results, bench/peers' `ours` rows,
a train.py run saved by hand with its command and the flags auto chose: what `--stack auto`
ran, checkpointed blocks, untiled MLP and all) against the bound of the
configuration each ran, measured now or, with --rates-from, a saved result's (no GPU); a step
profiled by bench.step --profile also gets its split: its GEMMs and attention as they ran in it,
each over its term of the bound, and the time with neither running:

    python -m bench.throughput --bound-of docs/results/peers_...json \
        --rates-from docs/results/throughput_llama3-8b_1gpu_bound_16k_64k.json

Single steps: pinned host buffers are cached by PyTorch once allocated, so the first row that
offloads at a length would pay their allocation and the rows after it would not; every row
therefore starts with the cache already holding its block inputs' buffers (`warm_pinned_cache`).
"""

import argparse
import dataclasses
import importlib
import json
import math
import os
import re
import shlex
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from base import host_buffers, kernels
from support import byte_counts
from support.step_time import step_flops
from model import get_model_args
import plan as planner
from bench import bound, ring
from bench.report import (GpuClocks, claim_result, default_out_dir, end_distributed,
                          refuse_without_gpu, release, result_path, synchronize, within_budget,
                          write_result)
from bench.step import with_layers
from support.data import parse_tokens
from support.errors import exit_on_error, quiet_unless_first_rank
from support.runtime import check_layout, read_machine, setup_runtime
from support.config import Config, checkpointed_layers, resolve_techniques, techniques_text

train = importlib.import_module("train")
GiB = 2**30
H200_BF16_PEAK = 989e12


# ---------------------------------------------------------------------------------------------
# One row: a method at a length and a depth.
# ---------------------------------------------------------------------------------------------

HOST_STATE = "+host-state"  # a method's suffix: the model state on the host (--offload-model-state)
KEEP_ATTENTION = "+keep-attention"  # a method's suffix: 03's --keep-attention
SUFFIXES = {HOST_STATE: "offload_model_state", KEEP_ATTENTION: "keep_attention"}  # -> Config field


RING = re.compile(r"\+ring:(\d+)")  # a method's suffix: 06's --ring R (Ulysses P/R x ring R)


def parse_method(method: str) -> tuple:
    """'untied:8+host-state@fa4' -> ('untied', 8, 'fa4'): the method, Untied's head chunk (None:
    train.py's choice), the attention kernel (--attn-kernel; 'auto' when not given). The
    suffixes +host-state (model state on the host, 01's --offload-model-state), +keep-attention
    (03's --keep-attention) and +ring:R (06's ring of R around Ulysses: 'ulysses+ring:2@fa4')
    are read by `method_config`."""
    for suffix in SUFFIXES:
        method = method.replace(suffix, "")
    method = RING.sub("", method)
    method, _, kernel = method.partition("@")
    name, _, chunk = method.partition(":")
    return name, int(chunk) if chunk else None, kernel or "auto"


def alst_config(model: str, device: str, dtype: str) -> Config:
    """The stack every row runs under its method: FSDP, checkpointing and its offload, the tiled
    MLP and loss (ALST's)."""
    return Config(model=model, device=device, steps=0, fsdp=True, checkpoint=True, offload=True,
                  tile_mlp=True, tile_loss=True, dtype=dtype)


def method_config(base: Config, method: str, model_name: str, seq_len: int) -> Config:
    name, chunk, kernel = parse_method(method)
    ring = RING.search(method)
    cfg = dataclasses.replace(base, model=model_name, seq_len=seq_len, attn_kernel=kernel,
                              ulysses=name == "ulysses", untied=name == "untied", head_chunk=chunk,
                              ring=int(ring.group(1)) if ring else base.ring,
                              **{field: getattr(base, field) or suffix in method
                                 for suffix, field in SUFFIXES.items()})
    return resolve_techniques(cfg)


def warm_pinned_cache(cfg: Config, rt) -> None:
    """Allocate and free the pinned buffers this row's offload will ask for (the offloader's
    HostBuffer, the same pieces), so PyTorch's host cache holds them and no row's timed step
    pays for pinning memory (~1 s for 4 GiB)."""
    if not (cfg.offload and rt.device.type == "cuda"):
        return
    args, dtype = get_model_args(cfg.model), getattr(torch, cfg.dtype)
    sizes = [cfg.batch_size * cfg.seq_len // rt.sp * args.dim * dtype.itemsize]
    if cfg.keep_attention:
        sizes += byte_counts.kept_attention_bytes(args, cfg.batch_size * cfg.seq_len, rt.sp,
                                                  dtype.itemsize)
    buffers = [host_buffers.HostBuffer((n,), torch.uint8, pinned=True)
               for _ in range(args.n_layers - 1) for n in sizes]
    del buffers


def time_steps(method: str, cfg: Config, steps: int, ring_gqa: str) -> dict:
    """Build the model for `cfg` and time `steps` optimizer steps: the median of those after
    the first counts."""
    rt = setup_runtime(cfg)
    vocab = get_model_args(cfg.model).vocab_size
    # Ring and sequence parallelism: one sequence shared by all ranks; none: one per rank.
    seed = rt.rank if method == "none" else 0
    tokens = torch.randint(0, vocab, (1, cfg.seq_len + 1),
                           generator=torch.Generator().manual_seed(seed))
    model = optimizer = None
    try:
        model = train.build_model(cfg, rt)
        if method == "ring":
            ring.use_ring_attention(model, ring_gqa)
            mesh = ring.context_parallel_mesh(rt.device.type)
            step_fn = lambda: ring.ring_forward_backward(model, tokens, rt, mesh)  # noqa: E731
        else:
            step_fn = lambda: train.forward_backward(model, tokens, rt)  # noqa: E731
        optimizer = train.make_optimizer(model, cfg)
        warm_pinned_cache(cfg, rt)
        times, peaks = [], []
        for _ in range(steps):
            synchronize(rt.device)
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = step_fn()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(rt.device)
            times.append(time.perf_counter() - start)
            if rt.device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated() / GiB)
        row = {"status": "ok", "step_times_s": times,
               "step_time_s": statistics.median(times[1:] or times),
               "peak_gib": peaks[-1] if peaks else None, "loss": float(loss)}
    except torch.OutOfMemoryError as error:  # errors.StepOutOfMemory is one
        row = {"status": "OOM", "error": str(error).split("\n")[0]}
    model = optimizer = None  # frees them; step_fn's closure shares these names, so no `del`
    release(rt.device)
    dist.barrier()
    return row


# ---------------------------------------------------------------------------------------------
# The table (a step's FLOPs: support/step_time.py's step_flops, the speed model's count; the
# kernels' bound: bench/bound.py).
# ---------------------------------------------------------------------------------------------

def summarize(rows: list[dict], args, world: int, rates: dict,
              matmul: dict | None = None, recompute_logits: bool = False) -> list[dict]:
    """Per (method, length): extrapolated full-depth step, tokens/s per GPU, MFU, kernel bound
    (rates: the attention kernel's, by "LENGTH@KERNEL"; matmul: the GEMMs' term, by
    `matmul_key`)."""
    table = []
    keys = sorted({(r["method"], r["seq_len"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for method, seq_len in keys:
        by_depth = {r["layers"]: r for r in rows
                    if (r["method"], r["seq_len"]) == (method, seq_len)}
        entry = {"method": method, "seq_len": seq_len}
        chunks = {r["head_chunk"] for r in by_depth.values() if r.get("head_chunk")}
        if chunks:
            entry["head_chunk"] = chunks.pop() if len(chunks) == 1 else sorted(chunks)
        one, two, full = by_depth.get(1), by_depth.get(2), by_depth.get(args.n_layers)
        statuses = {r["status"] for r in by_depth.values()}
        if full and full["status"] == "ok":
            step, how = full["step_time_s"], "measured at full depth"
        elif one and two and one["status"] == two["status"] == "ok":
            per_layer = two["step_time_s"] - one["step_time_s"]
            step = one["step_time_s"] + (args.n_layers - 1) * per_layer
            how = f"extrapolated from 1 and 2 layers to {args.n_layers}"
        else:
            entry["status"] = "OOM" if "OOM" in statuses else "not run"
            table.append(entry)
            continue
        sequences = world if parse_method(method)[0] == "none" else 1
        tokens_per_gpu = seq_len * sequences / world
        flops = step_flops(args, seq_len, sequences, KEEP_ATTENTION in method,
                           recompute_logits=recompute_logits)
        entry.update(status="ok", step_time_s=step, how=how,
                     tokens_per_s_per_gpu=tokens_per_gpu / step,
                     mfu=(flops["attention"] + flops["linear"]) / (step * world * H200_BF16_PEAK))
        rate = rates.get(f"{seq_len}@{parse_method(method)[2]}")
        gemms = (matmul or {}).get(matmul_key(method, seq_len))
        if rate and gemms:
            entry.update(bound.kernel_bound(flops["attention"] / world, rate,
                                            gemms["matmul_s"], flops["linear"] / world))
            entry["step_over_bound"] = step / entry["kernel_bound_s"]
        table.append(entry)
    return table


LOSS_TILES, RECOMPUTED_LOSS_TILES = bound.LOSS_TILES, bound.RECOMPUTED_LOSS_TILES


def recomputes_logits(result: dict) -> bool:
    """Whether a result's tiled loss ran lm_head again in backward (its bound counts it)."""
    return result.get("loss_tiles", RECOMPUTED_LOSS_TILES) != LOSS_TILES


def matmul_key(method: str, seq_len: int) -> str:
    return f"{seq_len} {method}"


def faster_than_bounds(table: list[dict]) -> list[str]:
    """The errors of the entries whose step is faster than their kernels' bound."""
    errors = [bound.faster_than_bound(e["step_time_s"], e, f"{e['method']} at {e['seq_len']:,} "
                                      f"tokens ({e['how']})")
              for e in table if e.get("status") == "ok" and "kernel_bound_s" in e]
    return [error for error in errors if error]


def stop_if_faster_than_bound(table: list[dict], device) -> None:
    """Stop every rank when rank 0's table has a step faster than its bound (the error says
    which term of the bound is wrong); each rank measured its own, rank 0's are written."""
    errors = faster_than_bounds(table)
    flag = torch.tensor([float(bool(errors))], device=device)
    dist.broadcast(flag, 0)
    if flag.item():
        end_distributed()
        raise SystemExit("bench.throughput: " + ("; ".join(errors) if errors
                                                 else "rank 0 found a step faster than its bound"))


def matmul_term(cfg: Config, method: str, seq_len: int, world: int, device, dtype,
                measured: dict, recompute_logits: bool = False) -> dict:
    """The bound's GEMM term of one GPU of a row at full depth (cfg: the full-depth config);
    `measured` keeps each shape's times (bound.matmul_seconds times the shapes it lacks)."""
    gemms, tokens = row_gemms(cfg, method, seq_len, world, recompute_logits)
    return {"matmul_s": bound.matmul_seconds(gemms, device, dtype, measured),
            "linear_flops_per_gpu": bound.gemm_flops(gemms), "tokens_per_gpu": tokens,
            "gemms": gemms}


def row_gemms(cfg: Config, method: str, seq_len: int, world: int,
              recompute_logits: bool = False) -> tuple[list, int]:
    """(bound.step_gemms of one GPU of a row, its tokens)."""
    cp = parse_method(method)[0] != "none"
    tokens = seq_len // world if cp else seq_len
    ulysses = world // (cfg.ring or 1) if cp else 1
    return bound.step_gemms(get_model_args(cfg.model), cfg, tokens, ulysses,
                            recompute_logits), tokens


def full_depth_config(base: Config, method: str, seq_len: int, saved: dict) -> Config:
    """A saved row's full-depth config, with the head chunk and MLP tile it ran (rows from
    before the MLP tile was recorded ran 04's default; before U was, 05's default U = P)."""
    ran = [r for r in saved["rows"] if (r["method"], r["seq_len"]) == (method, seq_len)]
    cfg = method_config(base, method, saved["model"], seq_len)
    if cfg.untied:
        cfg.head_chunk = ran[0].get("head_chunk") or saved["world_size"]
    cfg.mlp_tile_tokens = ran[0].get("mlp_tile_tokens")
    return cfg


def recount(path: str) -> list[dict]:
    """--recount: no GPU and no step. An earlier result's table against its own measured rates
    and GEMM times, with the GEMMs counted as bench/bound.py counts them now (where the count
    was wrong then: a bound is only as honest as its count). Every shape must have been timed
    then; the result's file is left as it is."""
    saved = json.loads(Path(path).read_text())
    if not saved.get("gemm_times_ms"):
        raise SystemExit(f"--recount {path}: no GEMM times in it (a result from before "
                         f"bench/bound.py timed the step's GEMMs): its bound cannot be recounted")
    args = get_model_args(saved["model"])
    base = alst_config(saved["model"], "cpu", saved["dtype"])
    recompute_logits, times, matmul = recomputes_logits(saved), saved["gemm_times_ms"], {}
    for key in saved["matmul"]:
        seq_len, method = key.split(" ", 1)
        cfg = full_depth_config(base, method, int(seq_len), saved)
        gemms, _ = row_gemms(cfg, method, int(seq_len), saved["world_size"], recompute_logits)
        untimed = sorted({bound.shape_key(g) for g in gemms} - set(times))
        if untimed:
            raise SystemExit(f"--recount {path}: {key} now counts GEMM shapes that were not "
                             f"timed then ({untimed}): measure them again (--rows-from)")
        matmul[key] = matmul_term(cfg, method, int(seq_len), saved["world_size"], "cpu", None,
                                  times, recompute_logits)
    return summarize(saved["rows"], args, saved["world_size"], saved["kernel_rates"], matmul,
                     recompute_logits)


def full_depth_steps(path: str) -> list[dict]:
    """--bound-of: the full-depth steps of one GPU that a saved result holds, each {"what",
    "cfg", "step_time_s", "kernel", "loss_tiles"}: bench.step's (the Config it ran, the median
    of its steps after the first), bench/peers' `ours` rows (each with its Config, recorded
    since the clip moved into AdamW's pass) or a train.py run saved by hand (its `command` and
    the flags `--stack auto` `chosen`). Refused: another GPU count, fewer layers, a row without
    its Config, a tiled loss that does not say how it ran."""
    saved = json.loads(Path(path).read_text())
    gpus = saved.get("world_size", saved.get("gpu_count"))
    if gpus != 1:
        raise SystemExit(f"--bound-of {path}: {gpus} GPUs; one GPU's steps only")
    if "config" in saved:  # bench.step
        if saved.get("status") != "ok":
            raise SystemExit(f"--bound-of {path}: its step did not complete "
                             f"({saved.get('status')})")
        if saved.get("layers"):
            raise SystemExit(f"--bound-of {path}: {saved['layers']} layers, not full depth")
        found = [(f"{Path(path).name}", saved["config"], saved.get("step_time_s"),
                  saved.get("attention_kernel"), saved.get("loss_tiles"), saved.get("profile"))]
    elif "chosen" in saved:  # a train.py run saved by hand: its command and what auto chose
        words = shlex.split(saved.get("command", ""))
        at = next((i for i, word in enumerate(words) if word.endswith("train.py")), None)
        if at is None:
            raise SystemExit(f"--bound-of {path}: its command runs no train.py")
        flags, unknown = planner.config.flags_parser(planner.config.FLAG_GROUPS).parse_known_args(
            words[at + 1:] + shlex.split(saved["chosen"]))
        if unknown:
            raise SystemExit(f"--bound-of {path}: flags train.py no longer reads: {unknown}")
        flags.dtype = flags.dtype or "bfloat16"  # as on its GPU (read here, maybe on a CPU)
        cfg = planner.config.config_from_flags(flags, reads_weights=False)
        if cfg.stack is None or cfg.stack == planner.config.AUTO:
            raise SystemExit(f"--bound-of {path}: 'chosen' ({saved['chosen']!r}) names no "
                             f"--stack level: the plan it ran is unknown")
        kernel = cfg.attn_kernel
        if kernel == "auto":  # on a GPU auto takes FA4 first where it is installed, else cuDNN
            kernel = "fa4" if saved.get("flash_attn_4") else "cudnn"
        kernel_name = {"fa4": "FlashAttention-4", "cudnn": "cuDNN"}.get(kernel, kernel)
        found = [(Path(path).name, dataclasses.asdict(cfg), saved.get("step_time_s"),
                  kernel_name, saved.get("loss_tiles"), None)]
    else:  # bench/peers
        found = [(f"{Path(path).name} row {i} ({r['stack']})", r.get("config"), r["step_time_s"],
                  saved.get("stack_info", {}).get(r["stack"], {}).get("attention"),
                  r.get("loss_tiles"), r.get("profile"))
                 for i, r in enumerate(saved.get("rows", []))
                 if r["stack"].startswith("ours") and r.get("status") == "ok"]
    fields = {f.name for f in dataclasses.fields(Config)}
    steps = []
    for what, config, step_s, kernel_name, loss_tiles, profile in found:
        if not config or step_s is None:
            raise SystemExit(f"--bound-of {path}: {what} records no Config or no step time "
                             f"(bench/peers' rows record their Config since the clip moved into "
                             f"AdamW's pass): run it again")
        cfg = Config(**{k: v for k, v in config.items() if k in fields})
        if cfg.grad_accum != 1:
            raise SystemExit(f"--bound-of {path}: {what} ran {cfg.grad_accum} micro-batches a "
                             f"step; the bound counts one")
        if cfg.tile_loss and loss_tiles is None:
            raise SystemExit(f"--bound-of {path}: {what} does not say how its tiled loss ran "
                             f"(loss_tiles): the bound cannot count lm_head's products")
        kernel = next((k for k, name in (("fa4", "FlashAttention-4"), ("cudnn", "cuDNN"))
                       if name in str(kernel_name)), None)
        if kernel is None:
            raise SystemExit(f"--bound-of {path}: {what} ran attention {kernel_name!r}; the bound "
                             f"measures FlashAttention-4 or cuDNN")
        steps.append({"what": what, "cfg": cfg, "step_time_s": step_s, "kernel": kernel,
                      "loss_tiles": loss_tiles or LOSS_TILES, "gpu": saved.get("gpu"),
                      "profile": profile})
    if not steps:
        raise SystemExit(f"--bound-of {path}: no step of ours in it")
    return steps


def as_run(step: dict) -> tuple:
    """(model args, tokens, its tiled loss recomputed the logits, the GEMMs bench/bound.py
    counts) of one of full_depth_steps' steps, on its one GPU."""
    cfg, recompute_logits = step["cfg"], step["loss_tiles"] == RECOMPUTED_LOSS_TILES
    args, tokens = get_model_args(cfg.model), cfg.seq_len * cfg.batch_size
    return args, tokens, recompute_logits, bound.step_gemms(args, cfg, tokens, 1, recompute_logits)


def bound_steps(steps: list[dict], rates: dict, gemm_times: dict, device, dtype) -> list[dict]:
    """Table entries: each full-depth step against the bound of its own configuration (its
    GEMMs as bench/bound.py counts them for its Config and tiled loss, timed at their shapes:
    `gemm_times`, which times missing shapes on a GPU; the attention kernel's rate at its
    length: `rates`, by "LENGTH@KERNEL")."""
    table = []
    for step in steps:
        cfg, (args, tokens, recompute_logits, gemms) = step["cfg"], as_run(step)
        flops = step_flops(args, cfg.seq_len, cfg.batch_size, cfg.keep_attention,
                           checkpoint=cfg.checkpoint, tile_mlp=cfg.tile_mlp,
                           tile_loss=cfg.tile_loss, checkpoint_layers=cfg.checkpoint_layers,
                           recompute_logits=recompute_logits)
        matmul_s = bound.matmul_seconds(gemms, device, dtype, gemm_times)
        entry = {"method": "as run", "seq_len": cfg.seq_len, "status": "ok",
                 "step_time_s": step["step_time_s"], "how": step["what"],
                 "techniques": techniques_text(cfg, cfg.head_chunk, cfg.ring or 1),
                 "tokens_per_s_per_gpu": tokens / step["step_time_s"],
                 "mfu": (flops["attention"] + flops["linear"])
                 / (step["step_time_s"] * H200_BF16_PEAK),
                 **bound.kernel_bound(flops["attention"], rates[f"{cfg.seq_len}@{step['kernel']}"],
                                      matmul_s, flops["linear"])}
        entry["step_over_bound"] = entry["step_time_s"] / entry["kernel_bound_s"]
        entry.update(in_step(step.get("profile"), entry))
        table.append(entry)
    return table


def in_step(profile: dict | None, entry: dict) -> dict:
    """Where a profiled step's time went against its bound (bench.step --profile): its GEMMs
    and its attention calls as they ran in the step, each over its term of the bound (the
    kernels alone at their best), and the time with neither running (elementwise work, copies,
    the GPU idle). Which of the two a step over its bound loses to, read off one step."""
    classes = (profile or {}).get("profile_kernel_classes_ms")
    if not classes:
        return {}
    attention_ms = classes["attention forward"]["ms"] + classes["attention backward"]["ms"]
    return {"in_step_matmul_over_bound": classes["matmul"]["ms"] / 1e3 / entry["matmul_bound_s"],
            "in_step_attention_over_bound": attention_ms / 1e3 / entry["attention_bound_s"],
            "in_step_outside_ms": profile["profile_outside_matmul_and_attention_ms"],
            "in_step_idle_ms": profile["profile_compute_idle_ms"],
            "in_step_span_ms": profile["profile_span_ms"]}


def add_back_to_back(steps: list[dict], table: list[dict], device, dtype, seconds: float):
    """To each of bound_steps' entries, its step's kernels run back to back for `seconds`
    (bench/bound.py's back_to_back: the GEMMs the bound counts, the attention calls whose FLOPs
    its attention term holds), and the step's time over a pass."""
    for step, entry in zip(steps, table):
        cfg, (args, _, _, gemms) = step["cfg"], as_run(step)
        flops = entry["attention_bound_s"] * entry["attention_flops_per_s"]
        kernels.use_kernel(step["kernel"])
        entry.update(bound.back_to_back(gemms, args, cfg.seq_len,
                                        *attention_calls(args, cfg, flops), device, dtype,
                                        seconds))
        entry["step_over_back_to_back"] = entry["step_time_s"] / entry["back_to_back_s"]


def attention_calls(args, cfg: Config, flops: float) -> tuple[int, int]:
    """(forward + backward calls, forward calls alone) of a step's attention over all heads:
    one of each per layer and sequence, and a forward again in each block 03 recomputes
    without --keep-attention; checked against the FLOPs the bound counts (`flops`)."""
    both = args.n_layers * cfg.batch_size
    again = 0 if cfg.keep_attention else checkpointed_layers(cfg, args.n_layers) * cfg.batch_size
    counted = bound.attention_flops(args, cfg.seq_len) * (both + again / 3.5)
    if not math.isclose(counted, flops, rel_tol=1e-9):
        raise SystemExit(f"--back-to-back-s: {both} attention calls and {again} forwards make "
                         f"{counted:.4g} FLOPs, the bound counts {flops:.4g}")
    return both, again


def bound_now(paths: list, result: dict, rt, dtype, repeats: int,
              back_to_back_s: float = 0) -> list[dict]:
    """--bound-of on a GPU: the steps against the attention kernel's rate at each length and
    their GEMMs' times, measured now on this GPU (kept in `result`); with back_to_back_s, also
    their kernels back to back for that long, as a step runs them."""
    steps = [step for path in paths for step in full_depth_steps(path)]
    if len({s["cfg"].model for s in steps}) > 1:
        raise SystemExit("--bound-of: steps of one model per run (the kernel's rate is its heads')")
    result["model"] = steps[0]["cfg"].model  # the steps', whatever --model said
    args = get_model_args(result["model"])
    # the SM clock and power while the kernels are timed alone (bench.step records them in a
    # step): a step's GEMMs ran 10% slower than these timings
    with GpuClocks.of(rt.device) as clocks:
        for seq_len, kernel in sorted({(s["cfg"].seq_len, s["kernel"]) for s in steps}):
            kernels.use_kernel(kernel)
            result["kernel_rates"][f"{seq_len}@{kernel}"] = {
                **bound.attention_rate(args, seq_len, rt.device, dtype, repeats),
                "kernel": kernels.attention_kernel_name(rt.device, dtype, args.head_dim)}
        table = bound_steps(steps, result["kernel_rates"], result["gemm_times_ms"], rt.device,
                            dtype)
    result["gpu_clocks_during_bound"] = clocks.summary
    if back_to_back_s:  # after the bound's clocks: these draw the card's sustained power
        add_back_to_back(steps, table, rt.device, dtype, back_to_back_s)
    return table


def bound_of_saved_rates(paths: list, rates_path: str) -> list[dict]:
    """--bound-of with --rates-from: no GPU. The steps against the kernel rates and GEMM times a
    bench.throughput result measured (same GPU kind); a length it has no rate for, or a GEMM
    shape it did not time, is refused."""
    saved = json.loads(Path(rates_path).read_text())
    steps = [step for path in paths for step in full_depth_steps(path)]
    for step in steps:
        cfg = step["cfg"]
        if cfg.model != saved["model"]:
            raise SystemExit(f"--rates-from {rates_path}: rates of {saved['model']}, a step of "
                             f"{cfg.model} (the kernel's rate is its heads')")
        if (step["gpu"], cfg.dtype) != (saved.get("gpu"), saved["dtype"]):
            raise SystemExit(f"--rates-from {rates_path}: rates of {saved['dtype']} on "
                             f"{saved.get('gpu')}, a step of {cfg.dtype} on {step['gpu']}")
        if f"{cfg.seq_len}@{step['kernel']}" not in saved["kernel_rates"]:
            raise SystemExit(f"--rates-from {rates_path}: no {step['kernel']} rate at "
                             f"{cfg.seq_len:,} tokens (it has {sorted(saved['kernel_rates'])})")
        untimed = sorted({bound.shape_key(g) for g in as_run(step)[3]}
                         - set(saved["gemm_times_ms"]))
        if untimed:
            raise SystemExit(f"--rates-from {rates_path}: {step['what']} runs GEMM shapes it did "
                             f"not time ({untimed}): run --bound-of on a GPU")
    return bound_steps(steps, saved["kernel_rates"], saved["gemm_times_ms"], "cpu", None)


def method_label(entry: dict) -> str:
    """A table entry's method, with Untied's head chunk (from `untied:U`, else the one train.py
    chose, recorded in the entry)."""
    name, chunk, kernel = parse_method(entry["method"])
    at = ("" if kernel == "auto" else f" {kernel}") + "".join(
        " " + suffix for suffix in SUFFIXES if suffix in entry["method"])
    if name != "untied":
        return name + at
    return f"untied U={chunk or entry.get('head_chunk') or 'P'}{at}"


PAPER_8XH100 = {  # tokens/s per GPU, Llama3-8B, 8 x H100 (Untied Ulysses paper's table)
    "paper: Ulysses": {131072: 2320, 262144: 1504, 524288: 879, 1048576: 475},
    "paper: UPipe (Untied)": {131072: 2281, 262144: 1487, 524288: 867, 1048576: 473},
    "paper: native PyTorch ring": {131072: 1374, 262144: 846, 524288: 474, 1048576: 250},
}


def plot(tables: list[list[dict]], path: Path, title: str) -> None:
    """Tokens/s per GPU against the length, ours (solid) next to the paper's rows (dashed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    ours = {}
    for table in tables:
        for e in table:
            if e.get("status") == "ok":  # one line per method and head chunk
                ours.setdefault(method_label(e), {})[e["seq_len"]] = e["tokens_per_s_per_gpu"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, points, style in ([(f"ours: {m}", p, "-o") for m, p in sorted(ours.items())]
                                 + [(m, p, "--") for m, p in PAPER_8XH100.items()]):
        lengths = sorted(points)
        ax.plot(lengths, [points[n] for n in lengths], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({n for p in ours.values() for n in p}),
                  [f"{n // 1024}K" if n < 2**20 else f"{n // 2**20}M"
                   for n in sorted({n for p in ours.values() for n in p})])
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(title)
    ax.legend(fontsize=7)
    plt.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main(argv=None):
    """The command line: its flags checked (parse_args), then the run; a failure we explain ends
    with `error: ...` and exit code 1 (support/errors.py), as train.py's."""
    exit_on_error(lambda: bench(parse_args(argv)))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", nargs="*", default=["128K", "256K", "512K", "1M"])
    parser.add_argument("--methods", nargs="+", default=["ulysses", "untied", "ring", "none"],
                        help="none, ring, ulysses, untied or untied:U, each optionally +host-state "
                             "(--offload-model-state), +keep-attention (--keep-attention) and "
                             "@KERNEL (--attn-kernel): ulysses@fa4 ulysses+keep-attention@fa4")
    parser.add_argument("--no-cp-up-to", default="256K", help="skip 'none' above this length")
    parser.add_argument("--steps", type=int, default=2,
                        help="steps per row; those after the first are timed")
    parser.add_argument("--single-step-above", default="512K")
    parser.add_argument("--validate", nargs="*", default=[],
                        help="METHOD:LENGTH rows to also run at full depth")
    parser.add_argument("--ring-gqa", choices=["native", "repeat"], default="native")
    parser.add_argument("--budget-s", type=float, default=540, help="skip what starts after this")
    parser.add_argument("--name", default=None, help="result file name")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rate-repeats", type=int, default=3,
                        help="timed calls of the attention kernel per length (after a warm-up)")
    parser.add_argument("--rows-from", nargs="+", default=None, metavar="JSON",
                        help="no steps: these results' rows against the bound measured now")
    parser.add_argument("--bound-of", nargs="+", default=None, metavar="JSON",
                        help="no steps: full-depth steps of one GPU measured before (bench.step's "
                             "results, bench/peers' ours rows) against the bound of the "
                             "configuration each ran, measured now (or --rates-from)")
    parser.add_argument("--back-to-back-s", type=float, default=0, metavar="SECONDS",
                        help="with --bound-of on a GPU: also run each step's kernels back to "
                             "back this long, as a step runs them (the clock a step's sustained "
                             "power leaves them; not a bound)")
    parser.add_argument("--rates-from", default=None, metavar="JSON",
                        help="with --bound-of, no GPU: the kernel rates and GEMM times this "
                             "bench.throughput result measured")
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                        help="no run: draw these results (merged) into a PNG next to the first")
    parser.add_argument("--recount", default=None, metavar="JSON",
                        help="no GPU, no run: this result's table against its own measured "
                             "rates, its GEMMs counted as bench/bound.py counts them now")
    with quiet_unless_first_rank():  # argparse's errors and --help: once (torchrun)
        opts = parser.parse_args(argv)
        check_flags(parser, opts)
    return opts


# The flags, refused by name before anything is measured or written (argparse's error: one line
# after the usage, exit code 2).

METHOD_NAMES = ("none", "ring", "ulysses", "untied")
METHOD_FORM = ("none, ring, ulysses, untied or untied:U, each optionally +host-state, "
               "+keep-attention, +ring:R and @KERNEL (ulysses+ring:2@fa4)")
RESULT_KEYS = {  # what each flag reads from its JSON files
    "--plot": ("a bench.throughput result", ("model", "gpu", "gpu_count", "world_size", "table")),
    "--recount": ("a bench.throughput result",
                  ("model", "dtype", "world_size", "rows", "kernel_rates")),
    "--rows-from": ("a bench.throughput result", ("model", "world_size", "rows")),
    "--rates-from": ("a bench.throughput result",
                     ("model", "dtype", "kernel_rates", "gemm_times_ms")),
    "--bound-of": ("a bench.step or bench/peers result", ()),
}


def result_name(opts, world: int) -> str:
    """The result's file name (without .json): --name, else the model, GPUs and device."""
    return opts.name or (f"throughput_{opts.model}_{world}gpu"
                         + ("" if opts.device == "cuda" else "_cpu"))


def method_error(method: str) -> str | None:
    """What is wrong with a --methods entry's form (what parse_method reads), or None."""
    bare = method
    for suffix in SUFFIXES:
        bare = bare.replace(suffix, "")
    bare, at, kernel = RING.sub("", bare).partition("@")
    name, colon, chunk = bare.partition(":")
    if name not in METHOD_NAMES:
        return f"unknown method {name!r}: expected {METHOD_FORM}"
    if colon and (name != "untied" or not chunk.isdigit() or int(chunk) < 1):
        return f"only untied takes a head chunk, a whole number >= 1 (untied:2), got {bare!r}"
    if at and kernel not in kernels.KERNELS:
        return f"the attention kernel must be one of {', '.join(kernels.KERNELS)}, got {kernel!r}"
    return None


def check_flags(parser, opts) -> None:
    """Every value refused by name (parser.error) before anything runs: counts, token counts,
    methods (their form, and each row's layout on WORLD_SIZE processes, as setup_runtime checks
    it), the JSON files read, and where the result goes (never over an earlier run's)."""
    if opts.rates_from and not opts.bound_of:
        parser.error("--rates-from is read by --bound-of: give the steps to bound")
    if opts.back_to_back_s and (not opts.bound_of or opts.rates_from):
        parser.error("--back-to-back-s runs the kernels of --bound-of's steps on this GPU: give "
                     "--bound-of FILES, without --rates-from")
    for flag, value in (("--steps", opts.steps), ("--rate-repeats", opts.rate_repeats)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not (math.isfinite(opts.budget_s) and opts.budget_s > 0):
        parser.error(f"--budget-s must be a finite number of seconds > 0, got {opts.budget_s}")
    if not (math.isfinite(opts.back_to_back_s) and opts.back_to_back_s >= 0):
        parser.error(f"--back-to-back-s must be a finite number of seconds >= 0, "
                     f"got {opts.back_to_back_s}")
    validate = [entry.rpartition(":") for entry in opts.validate]
    for entry, (method, colon, _) in zip(opts.validate, validate):
        if not (colon and method):
            parser.error(f"--validate {entry}: expected METHOD:LENGTH (ulysses:128K, "
                         f"untied:2:512K)")
    lengths = [("--seq-lens", text, text) for text in opts.seq_lens]
    lengths += [("--validate", entry, text) for entry, (_, _, text) in zip(opts.validate, validate)]
    lengths += [("--no-cp-up-to", opts.no_cp_up_to, opts.no_cp_up_to),
                ("--single-step-above", opts.single_step_above, opts.single_step_above)]
    for flag, given, text in lengths:
        try:
            parse_tokens(text)
        except ValueError as error:
            parser.error(f"{flag} {given}: {error}")
    for flag, given, method in ([("--methods", m, m) for m in opts.methods]
                                + [("--validate", entry, m)
                                   for entry, (m, _, _) in zip(opts.validate, validate)]):
        if method_error(method):
            parser.error(f"{flag} {given}: {method_error(method)}")
    try:
        args = get_model_args(opts.model)
    except ValueError as error:
        parser.error(f"--model: {error}")
    if opts.name is not None and (opts.name in ("", ".", "..") or "/" in opts.name
                                  or Path(opts.name).name != opts.name):
        parser.error(f"--name must be a file name, no folder (the result goes in --out), "
                     f"got {opts.name!r}")
    for flag, (what, keys) in RESULT_KEYS.items():
        given = getattr(opts, flag[2:].replace("-", "_"))
        for path in [given] if isinstance(given, str) else given or []:
            try:
                saved = json.loads(Path(path).read_text())
            except OSError as error:
                parser.error(f"{flag} {path}: cannot read it ({error.strerror})")
            except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
                parser.error(f"{flag} {path}: not a JSON file ({error})")
            missing = [k for k in keys if k not in saved] if isinstance(saved, dict) else keys
            if not isinstance(saved, dict) or missing:
                parser.error(f"{flag} {path}: not {what}"
                             + (f" (it has no {', '.join(missing)})" if missing else ""))
    if opts.plot or opts.recount or (opts.bound_of and opts.rates_from):
        return  # these read files and write no result
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not (opts.bound_of or opts.rows_from):  # else the rows are the files'
        check_rows(parser, opts, args, world)
    out_dir = Path(opts.out or default_out_dir())
    if out_dir.exists() and not out_dir.is_dir():
        parser.error(f"--out {out_dir} is a file: --out names the folder the result goes in")
    try:
        result_path(result_name(opts, world), str(out_dir))
    except FileExistsError as error:
        parser.error(str(error))


def check_rows(parser, opts, args, world: int) -> None:
    """Each row run_rows will run: its method at its length on `world` processes, refused here
    as setup_runtime would refuse it later (resolve_techniques and check_layout)."""
    base = alst_config(opts.model, opts.device, "float32")
    no_cp_up_to = parse_tokens(opts.no_cp_up_to)
    rows = [("--methods", m, parse_tokens(s)) for s in opts.seq_lens for m in opts.methods
            if not (parse_method(m)[0] == "none" and parse_tokens(s) > no_cp_up_to)]
    rows += [("--validate", m, parse_tokens(s))
             for m, _, s in (v.rpartition(":") for v in opts.validate)]
    for flag, method, seq_len in rows:
        if parse_method(method)[0] == "ring" and opts.device == "cpu":
            continue  # not run: the ring peer is CUDA only
        try:
            check_layout(method_config(base, method, opts.model, seq_len), world, args)
        except ValueError as error:
            parser.error(f"{flag} {method} at {seq_len:,} tokens on {world} process"
                         f"{'es' * (world > 1)}: {error}")


def bench(opts) -> None:
    if opts.recount:
        print_table(recount(opts.recount))
        return
    if opts.bound_of and opts.rates_from:
        print_table(bound_of_saved_rates(opts.bound_of, opts.rates_from))
        return
    if opts.plot:
        saved = [json.loads(Path(f).read_text()) for f in opts.plot]
        for run in saved:
            # Runs from before @KERNEL ran SDPA's cuDNN kernel (their "attention_kernel").
            cudnn = "cudnn" in str(run.get("attention_kernel", "")).lower()
            for e in run["table"]:  # runs before rows recorded U ran 05's default then, U = P
                e.setdefault("head_chunk", run["world_size"])
                if cudnn and "@" not in e["method"] and e["method"] not in ("ring", "none"):
                    e["method"] += "@cudnn"
        first = saved[0]
        plot([run["table"] for run in saved], Path(opts.plot[0]).with_suffix(".png"),
             f"{first['model']}, {first['gpu_count']} x {first['gpu']} (ours) vs 8 x H100 (paper)")
        return
    refuse_without_gpu("throughput.py", opts.model, opts.device,
                       "python -m bench.throughput --device cpu --model tiny --seq-lens 1K "
                       "--methods none ulysses untied")
    started = time.perf_counter()
    args = get_model_args(opts.model)
    base = alst_config(opts.model, opts.device,
                       "bfloat16" if opts.device == "cuda" else "float32")
    rt = setup_runtime(resolve_techniques(dataclasses.replace(base, seq_len=1024)))
    dtype = getattr(torch, base.dtype)
    methods = [m for m in opts.methods  # the ring peer is CUDA only
               if not (parse_method(m)[0] == "ring" and opts.device == "cpu")]
    result = {"what": "training step throughput: no CP, torch ring CP, Ulysses, Untied Ulysses",
              "model": opts.model, "dtype": base.dtype, "stack": "fsdp, checkpoint, offload, "
              "tile_mlp, tile_loss + the method", "ring_gqa": opts.ring_gqa,
              "peak_flops_per_gpu": H200_BF16_PEAK, "loss_tiles": LOSS_TILES,
              "depth_note": __doc__.split("Depth: ")[1].split("\n\n")[0],
              "attention_kernel": kernels.attention_kernel_name(rt.device, dtype, args.head_dim),
              "bound_note": bound.__doc__.split("\n\n")[0],
              "rows": [], "kernel_rates": {}, "matmul": {}, "gemm_times_ms": {}, "table": []}
    name = result_name(opts, rt.world)
    out_dir = Path(opts.out or default_out_dir())
    claim_result(name, out_dir)  # never over an earlier run's result

    in_budget = partial(within_budget, started, opts.budget_s, rt.device)

    def save():
        result["table"] = summarize(result["rows"], args, rt.world, result["kernel_rates"],
                                    result["matmul"], recomputes_logits(result))
        result["wall_s"] = time.perf_counter() - started
        if rt.rank == 0:
            write_result(name, result, out_dir, announce=False)
        stop_if_faster_than_bound(result["table"], rt.device)

    if opts.bound_of:
        result["bound_of"] = [{"file": str(p), "command": json.loads(Path(p).read_text())
                               .get("command")} for p in opts.bound_of]
        result["table"] = bound_now(opts.bound_of, result, rt, dtype, opts.rate_repeats,
                                    opts.back_to_back_s)
        result["wall_s"] = time.perf_counter() - started
        if rt.rank == 0:
            print_table(result["table"])
            print("\n".join(clock_lines(opts.bound_of, result["gpu_clocks_during_bound"])))
            write_result(name, result, out_dir)
        stop_if_faster_than_bound(result["table"], rt.device)
        end_distributed()
        return
    measure = partial(measure_bound, result, rt, dtype, opts.rate_repeats)
    if opts.rows_from:
        rebound_rows(opts.rows_from, result, base, rt, measure, in_budget)
    else:
        run_rows(opts, result, base, rt, dtype, methods, measure, in_budget, save)
    save()
    if rt.rank == 0:
        print_table(result["table"])
        print(f"wrote {out_dir / (name + '.json')}")
        if opts.device == "cuda":
            plot([result["table"]], out_dir / f"{name}.png",
                 f"{opts.model}, {rt.world} GPUs (ours) vs 8 x H100 (paper)")
    end_distributed()


def measure_bound(result: dict, rt, dtype, repeats: int, method: str, seq_len: int,
                  full_depth: Config) -> None:
    """The bound's two terms for a row (on a GPU): the attention kernel's rate at this length
    (once per length and kernel) and the full-depth step's GEMMs (once per method and length)."""
    if rt.device.type != "cuda":
        return
    kernel = parse_method(method)[2]
    rate_key = f"{seq_len}@{kernel}"  # each kernel its own rate
    if rate_key not in result["kernel_rates"]:
        kernels.use_kernel(kernel)
        args = get_model_args(full_depth.model)
        result["kernel_rates"][rate_key] = {
            **bound.attention_rate(args, seq_len, rt.device, dtype, repeats),
            "kernel": kernels.attention_kernel_name(rt.device, dtype, args.head_dim)}
    key = matmul_key(method, seq_len)
    if key not in result["matmul"]:
        result["matmul"][key] = matmul_term(full_depth, method, seq_len, rt.world, rt.device,
                                            dtype, result["gemm_times_ms"],
                                            recomputes_logits(result))


def run_rows(opts, result: dict, base: Config, rt, dtype, methods: list, measure,
             in_budget, save) -> None:
    """Each method and length at 1 and 2 layers (and --validate's at full depth): its bound,
    then its steps."""
    parse, args = parse_tokens, get_model_args(opts.model)
    plan = [(m, parse(s), layers) for s in opts.seq_lens for m in methods for layers in (1, 2)
            if not (parse_method(m)[0] == "none" and parse(s) > parse(opts.no_cp_up_to))]
    plan += [(m, parse(s), args.n_layers) for m, _, s in (v.rpartition(":") for v in opts.validate)]
    for method, seq_len, layers in plan:
        row = {"method": method, "seq_len": seq_len, "layers": layers}
        if not in_budget():
            result["rows"].append({**row, "status": "skipped (time budget)"})
            continue
        cfg = method_config(base, method, with_layers(opts.model, layers), seq_len)
        full_depth = dataclasses.replace(cfg, model=opts.model)
        if opts.device == "cuda":  # U and the MLP tile train.py takes for the full-depth model
            chosen = planner.plan_run(full_depth, read_machine(cfg)).settings
            cfg = dataclasses.replace(cfg, **{name: chosen[name] for name in
                                              ("head_chunk", "mlp_tile_tokens") if name in chosen})
            full_depth = dataclasses.replace(cfg, model=opts.model)
        measure(method, seq_len, full_depth)  # before the model: the GPU is free
        steps = 1 if seq_len > parse(opts.single_step_above) else opts.steps
        row.update(time_steps(parse_method(method)[0], cfg, steps, opts.ring_gqa), steps=steps,
                   attention_kernel=kernels.attention_kernel_name(rt.device, dtype, args.head_dim))
        if cfg.untied:
            row["head_chunk"] = cfg.head_chunk
        if cfg.mlp_tile_tokens:
            row["mlp_tile_tokens"] = cfg.mlp_tile_tokens
        result["rows"].append(row)
        if rt.rank == 0:
            print({k: v for k, v in row.items() if k != "step_times_s"}, flush=True)
        save()


def rebound_rows(paths: list, result: dict, base: Config, rt, measure, in_budget) -> None:
    """--rows-from: the rows of earlier results (same model and GPU count), no steps run; the
    bound measured now, for each row's method, length, head chunk and MLP tile as it ran (rows
    from before the MLP tile was recorded ran 04's default; before U was, 05's default U = P)."""
    for path in paths:
        saved = json.loads(Path(path).read_text())
        if (saved["model"], saved["world_size"]) != (result["model"], rt.world):
            raise SystemExit(f"--rows-from {path}: {saved['model']} on {saved['world_size']} "
                             f"GPUs, not {result['model']} on {rt.world}")
        loss_tiles = saved.get("loss_tiles", RECOMPUTED_LOSS_TILES)  # the bound counts as ran
        if result.get("rows_from") and loss_tiles != result["loss_tiles"]:
            raise SystemExit(f"--rows-from {path}: its tiled loss ran {loss_tiles!r}, an "
                             f"earlier file's {result['loss_tiles']!r}: one kind per run")
        result["loss_tiles"] = loss_tiles
        result.setdefault("rows_from", []).append(
            {"file": str(path), "git_commit": saved.get("git_commit"),
             "command": saved.get("command"), "gpu": saved.get("gpu")})
        known = {(r["method"], r["seq_len"], r["layers"]) for r in result["rows"]}
        again = [r for r in saved["rows"] if (r["method"], r["seq_len"], r["layers"]) in known]
        if again:
            raise SystemExit(f"--rows-from {path}: {again[0]['method']} at {again[0]['seq_len']} "
                             f"tokens is also in an earlier file: give one result per row")
        result["rows"] += [dict(r, rows_from=str(path)) for r in saved["rows"]]
    for method, seq_len in sorted({(r["method"], r["seq_len"]) for r in result["rows"]
                                   if r.get("status") == "ok"}, key=lambda k: (k[1], k[0])):
        if not in_budget():
            break
        measure(method, seq_len, full_depth_config(base, method, seq_len,
                                                   {**result, "world_size": rt.world}))


def clock_text(clocks: dict) -> str:
    """A GpuClocks summary's median SM clock and power."""
    return f"{clocks['sm_mhz_median']:,.0f} MHz at {clocks['power_w_median']:,.0f} W"


def clock_lines(paths: list, during_bound: dict | None) -> list:
    """The SM clock (median, MHz) and power (median, W) while the bound's kernels were timed
    beside those of each step file that recorded them (bench.step's gpu_clocks_during_steps):
    a sustained step can run at a lower clock than short timed kernels (the power cap)."""
    if not during_bound:
        return []
    lines = [f"SM clock, median: the bound's kernels alone {clock_text(during_bound)}"]
    for path in paths:
        steps = json.loads(Path(path).read_text()).get("gpu_clocks_during_steps")
        if steps:
            lines.append(f"  {Path(path).name}'s steps {clock_text(steps)}")
    return lines


def print_table(table: list) -> None:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print(f"\n{'tokens':>8} {'method':>12} {'step s':>9} {'tok/s/GPU':>10} {'MFU':>6} "
          f"{'bound s':>8} {'attn':>6} {'matmul':>6} {'/bound':>7}  how")
    for e in table:
        if e["status"] != "ok":
            print(f"{e['seq_len']:>8} {e['method']:>12} {e['status']:>9}")
            continue
        rates = [e.get(k) and e[k] / 1e12 for k in ("attention_flops_per_s", "matmul_flops_per_s")]
        print(f"{e['seq_len']:>8} {method_label(e):>12} {e['step_time_s']:>9.2f} "
              f"{e['tokens_per_s_per_gpu']:>10.1f} {e['mfu']:>6.1%} "
              f"{fmt(e.get('kernel_bound_s'), '.2f'):>8} {fmt(rates[0], '.0f'):>6} "
              f"{fmt(rates[1], '.0f'):>6} {fmt(e.get('step_over_bound'), '.3f'):>7}  {e['how']}")
        if e.get("in_step_matmul_over_bound"):
            print(f"{'':>8} {'':>12} its profiled step ({e['in_step_span_ms']:,.0f} ms): GEMMs "
                  f"{e['in_step_matmul_over_bound']:.3f}x their bound, attention "
                  f"{e['in_step_attention_over_bound']:.3f}x its, neither running "
                  f"{e['in_step_outside_ms']:,.0f} ms (the GPU idle {e['in_step_idle_ms']:,.0f})")
        if e.get("back_to_back_s"):
            clocks = e.get("gpu_clocks_back_to_back")
            print(f"{'':>8} {'':>12} the same kernels back to back for "
                  f"{e['back_to_back_seconds']:.0f} s: {e['back_to_back_s']:.3f} s a pass "
                  f"(the first {e['back_to_back_first_pass_s']:.3f})"
                  + (f", {clock_text(clocks)}" if clocks else "")
                  + f"; step / back to back {e['step_over_back_to_back']:.3f}")
    print("(attn, matmul: the bound's rates in TFLOP/s: the attention kernel at its best at that "
          "length, the step's GEMMs at their shapes; bench/bound.py)")


if __name__ == "__main__":
    main()
