"""The kernels' bound of a training step: the least time its two kinds of kernel could take.

    bound = attention FLOPs at the attention kernel's rate at its best, at the step's length
          + the step's own GEMMs, each timed at its shape

A step also runs norms, casts, copies and the optimizer, so it cannot be faster than its bound:
one that is (`faster_than_bound`) means a term was measured wrong, and bench.throughput stops.

Attention at its best: forward + backward, causal, all of the model's query heads with their KV
heads in one call (Llama-3-8B: 32 and 8, head_dim 128), over the step's whole length S, never a
shorter stand-in (a step at 1M runs its kernel at 1M). Why all heads in one call is the kernel's
best layout: a call is cut into (query tile, head) blocks that fill the GPU's SMs in waves; the
most heads give the most blocks (32 x S/128) for the same per-call costs (the launch, the last
partial wave, the backward's pre- and post-processing), and every query head of a KV group is in
the call, so each K/V tile loaded serves all of them (FlashAttention packs GQA). A step that
cuts the same heads over GPUs (Ulysses: H/P a call) or stages (Untied: U a call) does the same
FLOPs in smaller calls: at best as fast. A longer call is the kernel's best for the same reason
(more blocks per head), which is why the rate is taken at S itself. FLOPs: 2 S^2 (heads x
head_dim) forward (causal: half of the full product), backward 2.5x that, bench.throughput's
count. Timed two ways, the faster taken: the step's own call (the autograd Function, forward
then backward) and the kernel's forward and backward calls alone (base/kernels' lse entry
points, which 05 and --keep-attention call; no autograd, nothing allocated but the kernel's
outputs and its workspace). On one H200, FA4 in this layout: 612-623 TFLOP/s through the
step's call at 128K-1M; issue 43 quotes 664-668 for the kernel alone.

Matmul at the model's own shapes: the GEMMs the step runs on one GPU, each at its own (M, K, N)
(`step_gemms`): per layer q, k, v and o over the GPU's tokens (Untied Ulysses: q per stage of U
heads, k and v per KV group, as 05 projects them), gate, up and down over 04's MLP tiles, and
lm_head over 04's loss tiles; each product x W^T as often as the step runs it (the forward, and the
recompute of 03's checkpoint or of 04's tiled MLP: never down_proj's, whose output no recompute
reads, nor lm_head's, whose tiles run their backward in forward) and both backward products dY W
and dY^T x once. Their count is bench.throughput's linear FLOPs, shape by shape (tests check it).

Timing, both terms (bench.report.event_times_ms): CUDA events around each call, a warm-up call
first (compiles, cuBLAS handles, the allocator), the median of the repeats, random normal bf16
operands (never zeros: they run faster than data), rotated among enough sets that together they
exceed 4x the GPU's L2 cache, so no call finds the previous call's operands there.

Beside the bound, not a bound: `back_to_back` runs a step's same kernels one after another for
seconds, as a step runs them. Timed one call at a time the kernels run in short bursts at the
card's highest clock; for seconds on end they draw its power, and a card at its power cap (700 W
on an H100 or H200) lowers its clock. What a step reaches of the bound is then split into what
its kernels lose to the sustained clock and what is outside them.
"""

import itertools
import math
import statistics
import time

import torch

from bench.report import GpuClocks, event_times_ms, release, synchronize, upper_median
from base import kernels
from support.config import checkpointed_layers
from support.lessons import tiling, untied_sp as untied

LOSS_TILES = "gradients in forward"  # how 04's tiled loss runs; results before it say nothing:
RECOMPUTED_LOSS_TILES = "logits recomputed in backward"  # lm_head's product ran twice then
L2_MULTIPLE = 4  # the rotated operand sets exceed this many L2 caches
MAX_SETS = 16


def operand_sets(bytes_per_set: int, device) -> int:
    """How many operand sets to rotate among: together more than 4x the L2 cache (one where one
    set already is), at most 16."""
    if torch.device(device).type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
    return max(1, min(MAX_SETS, math.ceil(L2_MULTIPLE * l2 / max(bytes_per_set, 1))))


def random_sets(shapes: list, device, dtype, requires_grad: bool = False) -> list:
    """Operand sets of these shapes (random normal), as many as `operand_sets` asks for."""
    nbytes = sum(math.prod(shape) for shape in shapes) * dtype.itemsize
    return [tuple(torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad)
                  for shape in shapes) for _ in range(operand_sets(nbytes, device))]


# ---------------------------------------------------------------------------------------------
# Attention at its best.
# ---------------------------------------------------------------------------------------------

def attention_flops(args, seq_len: int, heads: int | None = None) -> float:
    """Forward + backward FLOPs of one causal call over `heads` query heads (default: all)."""
    return 2 * seq_len**2 * (heads or args.n_heads) * args.head_dim * (1 + 2.5)


def attention_rate(args, seq_len: int, device, dtype, repeats: int = 3) -> dict:
    """FLOP/s of the attention kernel (this process's --attn-kernel) at its best at `seq_len`:
    all query and KV heads in one call (module docstring), forward + backward, the faster of
    the step's call and the kernel's own calls alone."""
    shapes = [(1, seq_len, args.n_heads, args.head_dim),
              (1, seq_len, args.n_kv_heads, args.head_dim),
              (1, seq_len, args.n_kv_heads, args.head_dim)]
    sets = [(q, k, v, torch.randn_like(q.detach()))
            for q, k, v in random_sets(shapes, device, dtype, requires_grad=True)]

    def step_call(q, k, v, grad):
        q.grad = k.grad = v.grad = None
        kernels.causal_attention(q, k, v).backward(grad)

    through_step = event_times_ms(step_call, warmup=1, repeats=repeats, inputs=sets,
                                  device=device)
    sets = [(q.detach(), k.detach(), v.detach(), grad) for q, k, v, grad in sets]
    forward = event_times_ms(kernels.attention_forward_lse, warmup=1, repeats=repeats,
                             inputs=[(q, k, v) for q, k, v, _ in sets], device=device)
    with torch.no_grad():
        sets = [(grad, q, k, v, *kernels.attention_forward_lse(q, k, v))
                for q, k, v, grad in sets]
    backward = event_times_ms(kernels.attention_backward_lse, warmup=1, repeats=repeats,
                              inputs=sets, device=device)
    sets = None  # frees them before the rows that follow
    release(torch.device(device))
    alone_ms = upper_median(forward) + upper_median(backward)
    best_ms = min(upper_median(through_step), alone_ms)
    return {"attention_flops_per_s": attention_flops(args, seq_len) / (best_ms / 1e3),
            "attention_rate_seq_len": seq_len,
            "attention_layout": f"{args.n_heads} query / {args.n_kv_heads} KV heads, "
                                f"head_dim {args.head_dim}, one call, causal",
            "attention_rate_from": ("the kernel's calls alone" if alone_ms <= best_ms
                                    else "the step's call"),
            "attention_times_ms": [round(t, 3) for t in through_step],
            "kernel_alone_ms": {"forward": [round(t, 3) for t in forward],
                                "backward": [round(t, 3) for t in backward]}}


# ---------------------------------------------------------------------------------------------
# The step's GEMMs at their own shapes.
# ---------------------------------------------------------------------------------------------

def tile_sizes(n_tokens: int, tile_tokens: int) -> dict:
    """{rows of a tile: how many tiles} of 04's cut of n_tokens into tiles of tile_tokens."""
    sizes = {}
    for tile in tiling.token_tiles(n_tokens, tile_tokens):
        sizes[tile.stop - tile.start] = sizes.get(tile.stop - tile.start, 0) + 1
    return sizes


def step_gemms(args, cfg, tokens: int, ulysses: int = 1, recompute_logits: bool = False) -> list:
    """The GEMMs of one step on one GPU over its `tokens` tokens (Ulysses degree `ulysses`):
    [{"name", "m", "k", "n", "forward", "backward"}], forward: how many times the step runs
    x W^T (the forward and, where recomputed, the recompute), backward: how many times each of
    dY W and dY^T x. cfg: train.py's Config (checkpoint and its layers, untied, head_chunk, the
    tiles). Run again: the projections of the blocks 03 recomputes (--checkpoint-layers: the
    first k), the MLP's gate and up there or in every block under 04's tiling (its backward
    recomputes each tile), never down_proj (neither recompute needs its output: base/fused.py's
    SwiGLUDown and 04's tiles skip it), never lm_head (04's tiled loss runs each tile's backward
    in its forward; recompute_logits: as results measured before it did, when it ran lm_head
    again in backward)."""
    gemms = []

    def add(name, m, k, n, forward, backward):
        gemms.append({"name": name, "m": m, "k": k, "n": n, "forward": forward,
                      "backward": backward})

    layers, hd, dim = args.n_layers, args.head_dim, args.dim
    recomputed = checkpointed_layers(cfg, layers)
    mlp_again = layers if cfg.tile_mlp else recomputed  # blocks whose gate and up run again
    if cfg.untied:  # 05 projects per stage (q) and per KV group (k, v)
        chunk = untied.check_head_chunk(args.n_heads, args.n_kv_heads, ulysses, cfg.head_chunk)
        plan = untied.stage_plan(args.n_heads, args.n_kv_heads, ulysses, chunk)
        groups = untied.kv_groups(plan)
        kv_heads = groups[0][0]
        kv_width = ulysses * (kv_heads.stop - kv_heads.start) * hd
        add(f"q (a stage of U={chunk} heads)", tokens, dim, chunk * hd,
            len(plan) * (layers + recomputed), len(plan) * layers)
        for name in ("k", "v"):
            add(f"{name} (a KV group)", tokens, dim, kv_width,
                len(groups) * (layers + recomputed), len(groups) * layers)
    else:
        add("q", tokens, dim, args.n_heads * hd, layers + recomputed, layers)
        for name in ("k", "v"):
            add(name, tokens, dim, args.n_kv_heads * hd, layers + recomputed, layers)
    add("o", tokens, args.n_heads * hd, dim, layers + recomputed, layers)
    mlp_tile = (tiling.mlp_tile_size(dim, tokens, cfg.mlp_tile_tokens) if cfg.tile_mlp
                else tokens)
    for rows, count in tile_sizes(tokens, mlp_tile).items():
        for name, k, n, again in (("gate", dim, args.ffn_dim, mlp_again),
                                  ("up", dim, args.ffn_dim, mlp_again),
                                  ("down", args.ffn_dim, dim, 0)):
            add(f"{name} (MLP tile)", rows, k, n, count * (layers + again), count * layers)
    loss_tile = (tiling.loss_tile_size(args.vocab_size, tokens, cfg.loss_tile_tokens)
                 if cfg.tile_loss else tokens)
    for rows, count in tile_sizes(tokens, loss_tile).items():
        add("lm_head (loss tile)", rows, dim, args.vocab_size,
            count * (1 + (cfg.tile_loss and recompute_logits)), count)
    return gemms


def gemm_flops(gemms: list) -> float:
    return sum(2 * g["m"] * g["k"] * g["n"] * (g["forward"] + 2 * g["backward"]) for g in gemms)


def shape_key(gemm: dict) -> str:
    return f"{gemm['m']}x{gemm['k']}x{gemm['n']}"


def time_gemm(m: int, k: int, n: int, device, dtype, repeats: int = 5) -> dict:
    """Milliseconds (medians) of the three products of x (m, k) and a weight W (n, k)."""
    sets = random_sets([(m, k), (n, k), (m, n)], device, dtype)
    products = {"forward_ms": lambda x, w, dy: torch.nn.functional.linear(x, w),
                "grad_input_ms": lambda x, w, dy: dy @ w,
                "grad_weight_ms": lambda x, w, dy: dy.t() @ x}
    times = {}
    for name, product in products.items():
        ms = event_times_ms(product, warmup=1, repeats=repeats, inputs=sets, device=device)
        times[name] = round(upper_median(ms), 4)
    return times


def matmul_seconds(gemms: list, device, dtype, measured: dict) -> float:
    """The step's GEMMs' time on one GPU; `measured` ({shape_key: time_gemm(...)}) keeps each
    shape's times, so shapes that rows share are timed once."""
    total_ms = 0.0
    for g in gemms:
        key = shape_key(g)
        if key not in measured:
            measured[key] = time_gemm(g["m"], g["k"], g["n"], device, dtype)
        t = measured[key]
        total_ms += g["forward"] * t["forward_ms"] + g["backward"] * (t["grad_input_ms"]
                                                                      + t["grad_weight_ms"])
    release(torch.device(device))
    return total_ms / 1e3


# ---------------------------------------------------------------------------------------------
# The bound, and a step faster than it.
# ---------------------------------------------------------------------------------------------

def kernel_bound(attention_flops_per_gpu: float, rate: dict, matmul_s: float,
                 linear_flops_per_gpu: float) -> dict:
    """The bound's fields for a table entry (one GPU's share of the step)."""
    attention_s = attention_flops_per_gpu / rate["attention_flops_per_s"]
    return {"kernel_bound_s": attention_s + matmul_s, "attention_bound_s": attention_s,
            "matmul_bound_s": matmul_s,
            "attention_flops_per_s": rate["attention_flops_per_s"],
            "attention_rate_seq_len": rate["attention_rate_seq_len"],
            "matmul_flops_per_s": linear_flops_per_gpu / matmul_s if matmul_s else None}


def faster_than_bound(step_s: float, bound: dict, what: str) -> str | None:
    """None if the step takes at least its bound; else the error, naming the term that is wrong:
    the one that alone is longer than the step, else the larger (with the other taken as right,
    the rate it would need)."""
    total = bound["kernel_bound_s"]
    if step_s >= total:
        return None
    terms = {"attention": (bound["attention_bound_s"], bound["attention_flops_per_s"],
                           f"the kernel's rate at its best over {bound['attention_rate_seq_len']:,}"
                           f" tokens"),
             "matmul": (bound["matmul_bound_s"], bound["matmul_flops_per_s"],
                        "the step's GEMMs, timed at their shapes")}
    alone = [name for name, (seconds, _, _) in terms.items() if seconds >= step_s]
    wrong = alone[0] if alone else max(terms, key=lambda name: terms[name][0])
    other = next(name for name in terms if name != wrong)
    seconds, rate, how = terms[wrong]
    if alone:
        why = "alone it is longer than the step"
    else:
        needed = rate * seconds / (step_s - terms[other][0])
        why = (f"the larger term; with the {other} term right it would need "
               f"{needed / 1e12:.0f} TFLOP/s")
    return (f"{what}: the step ({step_s:.3f} s) is faster than its kernels' bound ({total:.3f} s"
            f" = attention {terms['attention'][0]:.3f} s + matmul {terms['matmul'][0]:.3f} s), "
            f"which a bound cannot be: the {wrong} term is wrong ({why}; measured "
            f"{(rate or 0) / 1e12:.0f} TFLOP/s, {how})")


# ---------------------------------------------------------------------------------------------
# The same kernels back to back: what they take under a step's sustained power.
# ---------------------------------------------------------------------------------------------

def back_to_back(gemms: list, args, seq_len: int, attention_calls: int, recomputed_forwards: int,
                 device, dtype, seconds: float) -> dict:
    """The bound's kernels run one after another, as a step runs them, for `seconds`: each of
    `gemms` its counts of times (x W^T, dY W, dY^T x, each call on the next operand set, as the
    bound times them), and the attention kernel over all heads at `seq_len`: forward and
    backward `attention_calls` times, forward alone `recomputed_forwards` times (03's recompute
    without --keep-attention). Not a bound: timed one call at a time, the kernels run in bursts
    at the card's highest clock; run for seconds, as a step runs, they draw the card's power
    and a capped card lowers its clock. A step with gaps may run its kernels at a higher clock
    than this. Returns the first pass's seconds (after a warm-up pass), the median pass of the
    run's second half and the SM clock and power over that half (None off a GPU)."""
    sets = {shape_key(g): random_sets([(g["m"], g["k"]), (g["n"], g["k"]), (g["m"], g["n"])],
                                      device, dtype) for g in gemms}
    shapes = [(1, seq_len, args.n_heads, args.head_dim)] + [
        (1, seq_len, args.n_kv_heads, args.head_dim)] * 2
    q, k, v = random_sets(shapes, device, dtype)[0]
    grad = torch.randn_like(q)
    calls = itertools.count()

    def operands(g):
        shape_sets = sets[shape_key(g)]
        return shape_sets[next(calls) % len(shape_sets)]

    def one_pass():
        for g in gemms:
            for _ in range(g["forward"]):
                x, w, _ = operands(g)
                torch.nn.functional.linear(x, w)
            for _ in range(g["backward"]):
                x, w, dy = operands(g)
                dy @ w
                dy.t() @ x
        for _ in range(recomputed_forwards):
            kernels.attention_forward_lse(q, k, v)
        for _ in range(attention_calls):
            out, lse = kernels.attention_forward_lse(q, k, v)
            kernels.attention_backward_lse(grad, q, k, v, out, lse)

    device = torch.device(device)
    with torch.no_grad():  # the warm-up: compiles, cuBLAS's handles, the allocator's blocks
        one_pass()
    synchronize(device)
    passes, started, steady_from = [], time.perf_counter(), None
    with torch.no_grad(), GpuClocks.of(device) as clocks:
        # at least two passes, however long one takes: the first is returned alone, and the
        # steady half then never is it
        while len(passes) < 2 or time.perf_counter() - started < seconds:
            if steady_from is None and time.perf_counter() - started >= seconds / 2:
                clocks.restart()  # the summary: the second half's samples
                steady_from = len(passes)
            begun = time.perf_counter()
            one_pass()
            synchronize(device)
            passes.append(time.perf_counter() - begun)
    steady = passes[steady_from:] if steady_from is not None else passes[-1:]
    sets = q = k = v = grad = None
    release(device)
    return {"back_to_back_s": statistics.median(steady),
            "back_to_back_first_pass_s": passes[0], "back_to_back_passes": len(passes),
            "back_to_back_seconds": round(time.perf_counter() - started, 1),
            "gpu_clocks_back_to_back": clocks.summary}
