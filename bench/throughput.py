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
            train.py chooses for the full-depth model: the fewest stages whose planned
            step fits the GPU).
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

FLOPs (per step, all GPUs), what MFU and the bound count: per layer, causal attention forward
2 S^2 d (d = heads x head dim), backward 2.5x forward, checkpoint recompute one more forward;
linear layers 2 x params x tokens forward, 2x that backward, recompute one more forward (the
tiled loss also recomputes lm_head in backward). MFU = FLOPs / (time x GPUs x 989 TFLOP/s, the
H200's dense bf16 peak). Kernel bound = attention FLOPs at the attention kernel's measured
standalone rate (this GPU, this run, one GPU's heads over min(S, 256K) tokens: the rate is
measured once more per length, at most 256K long to save time; on one H200 the rate at 512K
and 1M is the 256K rate to within 0.4% for FA4 and cuDNN, docs/results) + linear FLOPs at the
measured bf16 matmul rate; target: step time within 15% of it at >= 512K.

Single steps: pinned host buffers are cached by PyTorch once allocated, so the first row that
offloads at a length would pay their allocation and the rows after it would not; every row
therefore starts with the cache already holding its block inputs' buffers (`warm_pinned_cache`).
"""

import argparse
import dataclasses
import importlib
import json
import re
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from support import byte_counts, host_buffers, kernels
from model import ModelArgs, get_model_args
import plan as planner
from bench import ring
from bench.report import (cuda_time_ms, default_out_dir, end_distributed, refuse_without_gpu,
                          release, synchronize, within_budget, write_result)
from bench.step import with_layers
from support.data import parse_tokens

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


def method_config(base: train.Config, method: str, model_name: str, seq_len: int) -> train.Config:
    name, chunk, kernel = parse_method(method)
    ring = RING.search(method)
    cfg = dataclasses.replace(base, model=model_name, seq_len=seq_len, attn_kernel=kernel,
                              ulysses=name == "ulysses", untied=name == "untied", head_chunk=chunk,
                              ring=int(ring.group(1)) if ring else base.ring,
                              **{field: getattr(base, field) or suffix in method
                                 for suffix, field in SUFFIXES.items()})
    return train.resolve_techniques(cfg)


def warm_pinned_cache(cfg: train.Config, rt) -> None:
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


def time_steps(method: str, cfg: train.Config, steps: int, ring_gqa: str) -> dict:
    """Build the model for `cfg` and time `steps` optimizer steps: the median of those after
    the first counts."""
    rt = train.setup_runtime(cfg)
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
    except torch.OutOfMemoryError as error:  # train.StepOutOfMemory is one
        row = {"status": "OOM", "error": str(error).split("\n")[0]}
    model = optimizer = None  # frees them; step_fn's closure shares these names, so no `del`
    release(rt.device)
    dist.barrier()
    return row


# ---------------------------------------------------------------------------------------------
# FLOPs, and the kernels' standalone rates.
# ---------------------------------------------------------------------------------------------

def step_flops(args: ModelArgs, seq_len: int, sequences: int,
               keep_attention: bool = False) -> dict:
    """FLOPs of one step of `sequences` sequences of `seq_len` tokens (see the docstring);
    keep_attention: the recompute runs no attention forward."""
    d = args.n_heads * args.head_dim
    attention_forward = 2 * seq_len**2 * d * args.n_layers * sequences
    per_layer_params = (args.dim * d + 2 * args.dim * args.n_kv_heads * args.head_dim + d * args.dim
                        + 3 * args.dim * args.ffn_dim)
    linear_params = args.n_layers * per_layer_params + args.dim * args.vocab_size  # + lm_head
    linear_forward = 2 * linear_params * seq_len * sequences
    recompute = 0 if keep_attention else 1
    return {"attention": attention_forward * (1 + 2.5 + recompute),
            "linear": linear_forward * (1 + 2 + 1)}


def kernel_rates(args, local_heads: int, local_kv_heads: int, seq_len: int, local_tokens: int,
                 device, dtype) -> dict:
    """FLOP/s of the attention kernel (forward + backward, causal, one GPU's heads over the whole
    sequence) and of a bf16 matmul of one GPU's tokens through the MLP's up projection."""
    q = torch.randn(1, seq_len, local_heads, args.head_dim, device=device, dtype=dtype,
                    requires_grad=True)
    k, v = (torch.randn(1, seq_len, local_kv_heads, args.head_dim, device=device, dtype=dtype,
                        requires_grad=True) for _ in range(2))
    grad = torch.randn_like(q)

    def attention():
        q.grad = k.grad = v.grad = None
        kernels.causal_attention(q, k, v).backward(grad)

    attention_ms = cuda_time_ms(attention, warmup=1, repeats=1)
    attention_flops = 2 * seq_len**2 * local_heads * args.head_dim * (1 + 2.5)
    q = k = v = grad = None  # frees them (attention() shares these names)
    x = torch.randn(local_tokens, args.dim, device=device, dtype=dtype)
    w = torch.randn(args.dim, args.ffn_dim, device=device, dtype=dtype)
    matmul_ms = cuda_time_ms(lambda: x @ w, warmup=2, repeats=5)
    rates = {"attention_flops_per_s": attention_flops / (attention_ms / 1e3),
             "matmul_flops_per_s": 2 * local_tokens * args.dim * args.ffn_dim / (matmul_ms / 1e3),
             "attention_rate_seq_len": seq_len}
    x = w = None
    release(device)
    return rates


# ---------------------------------------------------------------------------------------------

def summarize(rows: list[dict], args, world: int, rates: dict) -> list[dict]:
    """Per (method, length): extrapolated full-depth step, tokens/s per GPU, MFU, kernel bound."""
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
        flops = step_flops(args, seq_len, sequences, KEEP_ATTENTION in method)
        entry.update(status="ok", step_time_s=step, how=how,
                     tokens_per_s_per_gpu=tokens_per_gpu / step,
                     mfu=(flops["attention"] + flops["linear"]) / (step * world * H200_BF16_PEAK))
        rate = rates.get(f"{seq_len}@{parse_method(method)[2]}")
        if rate:
            bound = (flops["attention"] / world / rate["attention_flops_per_s"]
                     + flops["linear"] / world / rate["matmul_flops_per_s"])
            entry.update(kernel_bound_s=bound, step_over_bound=step / bound)
        table.append(entry)
    return table


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


def main():
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
    parser.add_argument("--plot", nargs="+", default=None, metavar="JSON",
                        help="no run: draw these results (merged) into a PNG next to the first")
    opts = parser.parse_args()
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
    base = train.Config(model=opts.model, device=opts.device, steps=0, fsdp=True, checkpoint=True,
                        offload=True, tile_mlp=True, tile_loss=True,
                        dtype="bfloat16" if opts.device == "cuda" else "float32")
    rt = train.setup_runtime(train.resolve_techniques(dataclasses.replace(base, seq_len=1024)))
    dtype = getattr(torch, base.dtype)
    methods = [m for m in opts.methods  # the ring peer is CUDA only
               if not (parse_method(m)[0] == "ring" and opts.device == "cpu")]
    parse = parse_tokens
    result = {"what": "training step throughput: no CP, torch ring CP, Ulysses, Untied Ulysses",
              "model": opts.model, "dtype": base.dtype, "stack": "fsdp, checkpoint, offload, "
              "tile_mlp, tile_loss + the method", "ring_gqa": opts.ring_gqa,
              "peak_flops_per_gpu": H200_BF16_PEAK,
              "depth_note": __doc__.split("Depth: ")[1].split("\n\n")[0],
              "attention_kernel": kernels.attention_kernel_name(rt.device, dtype, args.head_dim),
              "rows": [], "kernel_rates": {}, "table": []}
    name = opts.name or (f"throughput_{opts.model}_{rt.world}gpu"
                         + ("" if opts.device == "cuda" else "_cpu"))
    out_dir = Path(opts.out or default_out_dir())

    in_budget = partial(within_budget, started, opts.budget_s, rt.device)

    def save():
        result["table"] = summarize(result["rows"], args, rt.world, result["kernel_rates"])
        result["wall_s"] = time.perf_counter() - started
        if rt.rank == 0:
            write_result(name, result, out_dir, announce=False)

    plan = [(m, parse(s), layers) for s in opts.seq_lens for m in methods for layers in (1, 2)
            if not (parse_method(m)[0] == "none" and parse(s) > parse(opts.no_cp_up_to))]
    plan += [(m, parse(s), args.n_layers) for m, _, s in (v.rpartition(":") for v in opts.validate)]
    for method, seq_len, layers in plan:
        rate_key = f"{seq_len}@{parse_method(method)[2]}"  # each kernel its own rate
        if opts.device == "cuda" and rate_key not in result["kernel_rates"] and in_budget():
            kernels.use_kernel(parse_method(method)[2])
            rate_len = min(seq_len, parse("256K"))  # longer: minutes per measurement (docstring)
            result["kernel_rates"][rate_key] = {**kernel_rates(
                args, args.n_heads // rt.world, max(args.n_kv_heads // rt.world, 1), rate_len,
                seq_len // rt.world, rt.device, dtype),
                "kernel": kernels.attention_kernel_name(rt.device, dtype, args.head_dim)}
        row = {"method": method, "seq_len": seq_len, "layers": layers}
        if not in_budget():
            result["rows"].append({**row, "status": "skipped (time budget)"})
            continue
        cfg = method_config(base, method, with_layers(opts.model, layers), seq_len)
        if opts.device == "cuda":  # what train.py would choose for the full-depth model
            gpu_mem = planner.smallest_gpu_memory(rt)
            full_depth = dataclasses.replace(cfg, model=opts.model)
            if cfg.untied and cfg.head_chunk is None:
                cfg.head_chunk = full_depth.head_chunk = planner.fewest_stages_that_fit(
                    full_depth, rt.world, gpu_mem)
            if cfg.tile_mlp and cfg.mlp_tile_tokens is None:
                cfg.mlp_tile_tokens = planner.largest_mlp_tile_that_fits(full_depth, rt.world,
                                                                         gpu_mem)
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
    save()

    if rt.rank == 0:
        fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
        print(f"\n{'tokens':>8} {'method':>12} {'step s':>9} {'tok/s/GPU':>10} {'MFU':>6} "
              f"{'bound s':>8} {'/bound':>7}  how")
        for e in result["table"]:
            if e["status"] != "ok":
                print(f"{e['seq_len']:>8} {e['method']:>12} {e['status']:>9}")
                continue
            print(f"{e['seq_len']:>8} {method_label(e):>12} {e['step_time_s']:>9.2f} "
                  f"{e['tokens_per_s_per_gpu']:>10.1f} {e['mfu']:>6.1%} "
                  f"{fmt(e.get('kernel_bound_s'), '.2f'):>8} "
                  f"{fmt(e.get('step_over_bound'), '.3f'):>7}  {e['how']}")
        print(f"wrote {out_dir / (name + '.json')}")
        if opts.device == "cuda":
            plot([result["table"]], out_dir / f"{name}.png",
                 f"{opts.model}, {rt.world} GPUs (ours) vs 8 x H100 (paper)")
    end_distributed()


if __name__ == "__main__":
    main()
