"""04 - Arctic Long Sequence Training (ALST) tiling: the MLP and the loss, a slice at a time.

The memory problem. After 01-03, Llama-3-8B at 3M tokens on 8 GPUs gives each GPU 393,216
tokens, and the largest allocations left are temporaries of per-token operations over the whole
local sequence:
  - the MLP, down(silu(gate(x)) * up(x)), keeps about three tokens x 14,336 intermediates for
    backward (gate, up, their product; 10.5 GiB each in bf16: 31.5 GiB per layer; five of them,
    52.5 GiB, at once inside its backward);
  - the loss needs the logits, tokens x 128,256 vocabulary entries: 188 GiB in fp32, and
    with base/fused.py's cross-entropy (bf16 logits, their bf16 gradient) its temporaries still
    come to 194 GiB (support/byte_counts.loss_temporary_bytes);
  - where an RMSNorm runs op by op (off CUDA) its backward holds six fp32 copies of its input:
    24 x 4,096 bytes per token, 36 GiB (on CUDA F.rms_norm is one fused kernel: --tile-norm is
    in no --stack level).

The idea. All three are independent per token: cut the local sequence into tiles and compute one
tile at a time. Forward keeps only the input. Backward recomputes one tile's intermediates, runs the
chain rule by hand, writes that tile's input gradient, and adds each weight's gradient into an fp32
sum with one matmul: on CUDA in bf16 (torch 2.11 on) cuBLAS accumulates straight into the fp32 sum,
so no tile leaves a bf16 product to round, cast and add (bench/grad_sums.py times both ways and
their errors). The sums are returned once: FSDP2 reduce-scatters each weight once. The loss, the
forward's last op, needs no recompute: each tile's backward runs right after its forward, for a loss
gradient of 1, and backward scales the input gradient and the sums by the gradient that arrives (as
ALST's TiledFusedLogitsLoss does). A 4,096-token MLP tile holds 0.55 GiB (five tile x ffn tensors
with base/fused.py's kernels; six op by op), a 2,092-token loss tile 1 GiB of fp32 logits and as
much for their softmax (on CUDA base/fused.py's cross-entropy reads the tile's bf16 logits and
writes their bf16 gradient: half of that). The price is one more forward of the MLP's gate and up
per step; under 03's checkpointing the tiled MLP skips its output in the block's recompute (nothing
there reads it), so gate and up still run forward twice. Every rank cuts the same number of tiles
(sizes follow shapes only): where tiles call collectives, a rank with fewer tiles deadlocks the
others.

Run the demo (peak memory of one MLP and of the loss, untiled vs tiled):

    python 04_alst_tiling.py                                   # CPU: small model, 16K tokens
    torchrun --nproc-per-node 2 04_alst_tiling.py --model llama3-8b --seq-len 128K   # GPUs
"""

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from model import rms_norm
from base import checkpointed, fused  # is_recomputing: 03 marks its recompute

GiB = 2**30
MAX_LOSS_TILE_LOGIT_BYTES = GiB  # default loss tile: at most this many bytes of fp32 logits


class TiledMLP(torch.autograd.Function):
    """model.MLP, down(silu(gate(x)) * up(x)), over x (tokens, dim) `tile_tokens` at a time.
    The weights are read by the caller at call time (under FSDP2: the gathered parameters)."""

    @staticmethod
    def forward(ctx, x, tile_tokens: int, gate_weight, up_weight, down_weight):
        weights = (gate_weight, up_weight, down_weight)
        ctx.save_for_backward(x, *weights)  # the input only: nothing per tile survives
        ctx.tile_tokens = tile_tokens
        if checkpointed.is_recomputing():
            # In 03's recompute the block is rerun only to rebuild what its ops save; this output
            # feeds nothing but the residual add that ends the block, and our backward recomputes
            # every tile anyway: computing it here would be a third forward.
            return torch.empty_like(x)
        return tiled_over_tokens(swiglu, x, (), weights, tile_tokens, sum_tiles=False)

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        grad_x, grad_sums = torch.empty_like(x), fp32_zeros_like(weights)
        for tile in token_tiles(len(x), ctx.tile_tokens):
            grad_x[tile] = swiglu_backward(x[tile], grad_out[tile], *weights, grad_sums)
        return grad_x, None, *in_weight_dtypes(grad_sums, weights)


def swiglu(x, gate_weight, up_weight, down_weight):
    """model.MLP's formula with its weights as arguments (silu(gate) * up: base/fused.py's one
    kernel on CUDA)."""
    return F.linear(fused.swiglu_forward(F.linear(x, gate_weight), F.linear(x, up_weight)),
                    down_weight)


def swiglu_backward(x, grad_out, gate_weight, up_weight, down_weight, grad_sums):
    """One tile of swiglu's backward: its intermediates recomputed (five tile x ffn tensors at
    most), each weight's gradient added into its fp32 sum in `grad_sums` (gate, up, down).
    Returns x's gradient."""
    gate, up = F.linear(x, gate_weight), F.linear(x, up_weight)
    # down: grad_out^T (silu(gate) * up), the product recomputed and dropped at once
    add_matmul(grad_sums[2], grad_out.t(), fused.swiglu_forward(gate, up))
    # the product's gradient through silu'(g) = s (1 + g (1 - s)), s = sigmoid(g): one kernel
    grad_gate, grad_up = fused.swiglu_backward(grad_out @ down_weight, gate, up)
    add_matmul(grad_sums[0], grad_gate.t(), x)
    add_matmul(grad_sums[1], grad_up.t(), x)
    return grad_gate @ gate_weight + grad_up @ up_weight


class TiledLoss(torch.autograd.Function):
    """model.Transformer.loss_sum (final norm + lm_head + cross-entropy summed over the tokens
    whose label counts) over h (tokens, dim) and labels (tokens,), `tile_tokens` at a time:
    logits of all tokens never exist at once. The loss is the forward's last op, so each
    tile's backward runs right after its forward, for a loss gradient of 1 (ALST's
    TiledFusedLogitsLoss does the same): no tile is computed twice. The loss is a sum, so its
    gradients are linear in the one that arrives: backward only scales them by it (h's, in h's
    dtype, is so rounded twice, as ALST's; the weights' fp32 sums once)."""

    @staticmethod
    def forward(ctx, h, labels, tile_tokens: int, eps: float, norm_weight, lm_head_weight):
        weights = (norm_weight, lm_head_weight)
        grad_h, grad_sums, loss = torch.empty_like(h), fp32_zeros_like(weights), 0
        for tile in token_tiles(len(h), tile_tokens):
            tile_loss, grad_h[tile] = tile_loss_and_backward(h[tile], labels[tile], *weights,
                                                             grad_sums, eps)
            loss = loss + tile_loss
        ctx.save_for_backward(grad_h, *grad_sums)
        ctx.weight_dtypes = [w.dtype for w in weights]
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, *grad_sums = ctx.saved_tensors
        # in place: nothing else holds them (a second backward would find them changed: an error)
        grads = [grad_h.mul_(grad_loss), *(total.mul_(grad_loss).to(dtype)
                                           for total, dtype in zip(grad_sums, ctx.weight_dtypes))]
        needed = [ctx.needs_input_grad[i] for i in (0, 4, 5)]
        h_grad, norm_grad, lm_head_grad = (g if need else None for g, need in zip(grads, needed))
        return h_grad, None, None, None, norm_grad, lm_head_grad


def norm_lm_head_loss(h, labels, norm_weight, lm_head_weight, *, eps: float):
    """model.Transformer.loss_sum's formula with its weights as arguments: the cross-entropy
    (fp32 statistics) summed over non-ignored labels (0, not NaN, when every label is ignored);
    base/fused.py's form: on CUDA one pass over the tile's bf16 logits."""
    return fused.cross_entropy_sum(F.linear(rms_norm(h, norm_weight, eps), lm_head_weight),
                                   labels)


def tile_loss_and_backward(h, labels, norm_weight, lm_head_weight, grad_sums, eps: float):
    """One tile of norm_lm_head_loss and its backward for a loss gradient of 1 (grad_sums:
    norm, lm_head). Returns (the tile's loss, h's gradient)."""
    normed = rms_norm(h, norm_weight, eps)
    logits = F.linear(normed, lm_head_weight)
    loss = fused.cross_entropy_sum(logits, labels)
    # softmax(row) - one_hot(label), from the tile's logits, in h's dtype; the logits die here
    grad_logits = fused.cross_entropy_backward(logits, labels, loss.new_ones(()))
    del logits
    add_matmul(grad_sums[1], grad_logits.t(), normed)  # lm_head: grad_logits^T normed
    return loss, rms_norm_backward(h, grad_logits @ lm_head_weight, norm_weight, grad_sums[0],
                                   eps)


def rms_norm_backward(x, grad_out, weight, weight_grad_sum, eps: float):
    """One tile of rms_norm's backward, in fp32: y = x_hat * w with x_hat = x / rms(x) gives
    dw = sum over tokens of dy * x_hat (added into weight_grad_sum) and
    dx = (g - x_hat * mean(g * x_hat)) / rms(x) with g = dy * w. Returns dx in x's dtype."""
    x32, grad32 = x.float(), grad_out.float()
    inv_rms = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x32 * inv_rms
    weight_grad_sum += (grad32 * x_hat).sum(0)
    g = grad32 * weight.float()
    return (inv_rms * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))).to(x.dtype)


class TiledNorm(torch.autograd.Function):
    """model.RMSNorm over x (tokens, dim), `tile_tokens` at a time (--tile-norm): what pays
    where the norm runs op by op, whose fp32 copies then exist for one tile at a time."""

    @staticmethod
    def forward(ctx, x, tile_tokens: int, eps: float, weight):
        ctx.save_for_backward(x, weight)  # the input, which the residual stream holds anyway
        ctx.tile_tokens, ctx.eps = tile_tokens, eps
        return tiled_over_tokens(partial(rms_norm, eps=eps), x, (), (weight,), tile_tokens,
                                 sum_tiles=False)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x, grad_sums = torch.empty_like(x), fp32_zeros_like([weight])
        for tile in token_tiles(len(x), ctx.tile_tokens):
            grad_x[tile] = rms_norm_backward(x[tile], grad_out[tile], weight, grad_sums[0],
                                             ctx.eps)
        return grad_x, None, None, *in_weight_dtypes(grad_sums, [weight])


# The tiles, and the weight gradients' fp32 sums.

def token_tiles(n_tokens: int, tile_tokens: int) -> list[slice]:
    """Consecutive slices of `tile_tokens` tokens; the last is shorter when they don't divide."""
    return [slice(start, min(start + tile_tokens, n_tokens))
            for start in range(0, n_tokens, tile_tokens)]


def tiled_over_tokens(fn, x, token_args, weights, tile_tokens: int, sum_tiles: bool):
    """fn(x_tile, *token_arg_tiles, *weights) tile by tile (the Functions' forwards, where
    autograd is off): the tiles' rows written into one buffer, or (sum_tiles) their scalars
    added. token_args are cut with x (labels); weights are used whole by every tile."""
    out = None
    for tile in token_tiles(len(x), tile_tokens):
        piece = fn(x[tile], *(t[tile] for t in token_args), *weights)
        if sum_tiles:
            out = piece if out is None else out + piece
        else:
            if out is None:
                out = piece.new_empty((len(x), *piece.shape[1:]))
            out[tile] = piece
    return out


# From torch 2.11 a CUDA matmul of bf16 inputs adds into an fp32 output itself (pytorch#167931;
# 2.8 to 2.10 wanted the added matrix in the inputs' dtype). The CPU has no such kernel.
# (Major and minor only: a pre-release, 2.11.0a0 or 2.11.0.dev, is 2.11 here.)
CUDA_FP32_ACCUMULATE = tuple(int(n) for n in torch.__version__.split(".")[:2]) >= (2, 11)


def add_matmul(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b into the fp32 total. On CUDA in bf16 (or fp16) one matmul reads and
    writes total as its addend, accumulating in fp32; elsewhere (the CPU, fp32 inputs, torch
    before 2.11) the fp32 matmul."""
    if CUDA_FP32_ACCUMULATE and a.is_cuda and a.dtype in (torch.bfloat16, torch.float16):
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total.addmm_(a.float(), b.float())


def fp32_zeros_like(weights) -> list[torch.Tensor]:
    """One fp32 sum per weight: in bf16 each of a hundred tiles' additions would round again."""
    return [torch.zeros_like(w, dtype=torch.float32) for w in weights]


def in_weight_dtypes(grad_sums, weights) -> list[torch.Tensor]:
    return [total.to(w.dtype) for total, w in zip(grad_sums, weights)]  # fp32: no copy


# --- Seams 3, 4 and 5: the MLP, the blocks' RMSNorms, the final norm + lm_head + loss ----------

def tiled_mlp_forward(mlp, x: torch.Tensor, tile_tokens: int | None = None) -> torch.Tensor:
    """model.MLP.forward, computed `tile_tokens` tokens at a time (batch and sequence together)."""
    rows = x.reshape(-1, x.shape[-1])  # one row per token
    tile_size = mlp_tile_size(x.shape[-1], len(rows), tile_tokens)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)  # read now: FSDP
    return TiledMLP.apply(rows, tile_size, *weights).view(x.shape)


def tiled_norm_forward(norm, x: torch.Tensor, tile_tokens: int | None = None) -> torch.Tensor:
    """model.RMSNorm.forward, computed `tile_tokens` tokens at a time."""
    rows = x.reshape(-1, x.shape[-1])
    tile_size = norm_tile_size(x.shape[-1], len(rows), tile_tokens)
    return TiledNorm.apply(rows, tile_size, norm.eps, norm.weight).view(x.shape)


def tiled_loss_sum(model, h: torch.Tensor, labels: torch.Tensor, tile_tokens: int | None = None):
    """model.Transformer.loss_sum, computed `tile_tokens` tokens at a time."""
    rows, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    weights = (model.norm.weight, model.lm_head.weight)  # read now: FSDP
    tile_size = loss_tile_size(weights[1].shape[0], len(rows), tile_tokens)
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (rows, *weights))):
        # no backward coming (evaluation): the loss alone, no gradient computed in forward
        return tiled_over_tokens(partial(norm_lm_head_loss, eps=model.norm.eps), rows,
                                 (flat_labels,), weights, tile_size, sum_tiles=True)
    return TiledLoss.apply(rows, flat_labels, tile_size, model.norm.eps, *weights)


def apply_tiling(model, tile_mlp: bool = True, tile_loss: bool = True,
                 mlp_tile_tokens: int | None = None, loss_tile_tokens: int | None = None,
                 tile_norm: bool = False) -> None:
    """Replace every block's MLP forward, its two RMSNorms' forwards and/or the model's
    loss_sum with their tiled versions (mlp_tile_tokens sets the norms' tiles too, as
    --mlp-tile-tokens does; eval.py tiles the loss's per-token sibling, token_scores, with
    tiled_over_tokens).

    Only forward functions are replaced (on the instances; parameter names are unchanged) and
    no parameter is captured, so this works on the meta device before checkpointing and FSDP.
    Tile sizes: tokens per tile, or None for the shape-derived defaults below.
    """
    check_tile_tokens("mlp_tile_tokens", mlp_tile_tokens)
    check_tile_tokens("loss_tile_tokens", loss_tile_tokens)
    if tile_mlp:
        for block in model.layers:
            block.mlp.forward = partial(tiled_mlp_forward, block.mlp, tile_tokens=mlp_tile_tokens)
    if tile_loss:
        model.loss_sum = partial(tiled_loss_sum, model, tile_tokens=loss_tile_tokens)
    if tile_norm:
        for block in model.layers:
            for norm in (block.input_layernorm, block.post_attention_layernorm):
                norm.forward = partial(tiled_norm_forward, norm, tile_tokens=mlp_tile_tokens)


# ---- below: checks, demo -------------------------------------------------------------------------

# Tile sizes, from shapes only (so every rank cuts the same number of tiles).

def check_tile_tokens(name: str, tile_tokens) -> None:
    if tile_tokens is not None and (isinstance(tile_tokens, bool)
                                    or not isinstance(tile_tokens, int) or tile_tokens < 1):
        raise ValueError(f"{name} must be a positive whole number of tokens, got {tile_tokens!r}")


def tile_count(n_tokens: int, tile_tokens: int) -> int:
    return max(1, -(-n_tokens // tile_tokens))


def even_tile_tokens(n_tokens: int, max_tile_tokens: int) -> int:
    """The fewest tiles of at most `max_tile_tokens`, made as equal as possible: 5,000 tokens
    with at most 4,096 per tile give two tiles of 2,500, not 4,096 + 904."""
    return max(1, -(-n_tokens // tile_count(n_tokens, max_tile_tokens)))


def mlp_tile_size(dim: int, n_tokens: int, tile_tokens: int | None = None) -> int:
    """Tokens per MLP tile: `tile_tokens` if set, else about `dim` (ALST's rule: ceil(tokens /
    dim) tiles). A tile's intermediates are then 3.5x its input (14,336 / 4,096 for Llama-3-8B),
    and each matmul is still (4096 x 4096) x (4096 x 14336): large enough to run at full speed."""
    return tile_tokens or even_tile_tokens(n_tokens, dim)


def norm_tile_size(dim: int, n_tokens: int, tile_tokens: int | None = None) -> int:
    """Tokens per RMSNorm tile: `tile_tokens` if set (--mlp-tile-tokens sets both), else about
    `dim`, as for the MLP: a tile's six fp32 copies are then 24 x dim x dim bytes (0.38 GiB for
    Llama-3-8B), and a tile is still thousands of tokens long."""
    return tile_tokens or even_tile_tokens(n_tokens, dim)


def loss_tile_size(vocab_size: int, n_tokens: int, tile_tokens: int | None = None) -> int:
    """Tokens per loss tile: `tile_tokens` if set, else so that a tile's fp32 logits are at most
    1 GiB (2,092 tokens for a 128,256-entry vocabulary)."""
    max_tile_tokens = max(1, MAX_LOSS_TILE_LOGIT_BYTES // (4 * vocab_size))
    return tile_tokens or even_tile_tokens(n_tokens, max_tile_tokens)


# Demo: one MLP and the loss at a long length, untiled vs tiled, beside support/byte_counts.py's
# estimates of them.

def main():
    from model import Transformer
    from support.byte_counts import loss_temporary_bytes, mlp_temporary_bytes
    from support.demos import (demo_parser, demo_setup, end_ranks, in_units, measure_phases,
                               measured_what, print_table)

    parser = demo_parser(__doc__, cpu=("small", "16K"), gpu=("llama3-8b", "128K"))
    parser.add_argument("--mlp-tile-tokens", type=int, default=None)
    parser.add_argument("--loss-tile-tokens", type=int, default=None)
    opts = parser.parse_args()
    check_tile_tokens("--mlp-tile-tokens", opts.mlp_tile_tokens)
    check_tile_tokens("--loss-tile-tokens", opts.loss_tile_tokens)
    if not torch.cuda.is_available() and opts.loss_tile_tokens is None:
        # The small model's 4,096-entry vocabulary allows 65,536 tokens under the 1 GiB rule:
        # one tile at this length. Use smaller tiles so the CPU demo shows the effect.
        opts.loss_tile_tokens = 1024
    demo = demo_setup(opts)  # under torchrun each rank holds seq_len / world tokens, as in 02
    args, n = demo.args, demo.local
    mlp_tile, loss_tile = opts.mlp_tile_tokens, opts.loss_tile_tokens  # None: from the shapes
    torch.manual_seed(0)
    with torch.device(demo.device):  # one block (for its MLP), the final norm and lm_head
        model = Transformer(replace(args, n_layers=1)).to(demo.dtype)
    fused.use_fused(model)  # the MLP and cross-entropy the planner counts (what training runs)
    mlp, generator = model.layers[0].mlp, torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab_size, (1, n), generator=generator).to(demo.device)
    phases = {"MLP untiled": lambda x: mlp(x),
              "MLP tiled": lambda x: tiled_mlp_forward(mlp, x, mlp_tile),
              "loss untiled": lambda h: type(model).loss_sum(model, h, labels),
              "loss tiled": lambda h: tiled_loss_sum(model, h, labels, loss_tile)}

    def new_input():  # the MLP's input or the last hidden state: (1, n, dim)
        return torch.randn(1, n, args.dim, generator=generator).to(demo.device, demo.dtype)

    measured = measure_phases(phases, new_input, model)
    b = demo.dtype.itemsize
    planned = {"MLP untiled": mlp_temporary_bytes(args, n, False, mlp_tile, b),
               "MLP tiled": mlp_temporary_bytes(args, n, True, mlp_tile, b),
               "loss untiled": loss_temporary_bytes(args, n, False, loss_tile, b, demo.on_gpu),
               "loss tiled": loss_temporary_bytes(args, n, True, loss_tile, b, demo.on_gpu)}
    if demo.rank == 0:
        mlp_tokens = mlp_tile_size(args.dim, n, mlp_tile)
        loss_tokens = loss_tile_size(args.vocab_size, n, loss_tile)
        print(f"{demo.setting}; MLP tiles of {mlp_tokens:,} tokens ({tile_count(n, mlp_tokens)} "
              f"tiles), loss tiles of {loss_tokens:,} ({tile_count(n, loss_tokens)} tiles)")
        print(f"GiB, forward+backward: {measured_what(demo.on_gpu)}; the largest tensor; the "
              f"planner's estimate in this dtype (GPU peak in backward)")
        rows = [[name, *(in_units(nbytes, GiB, 3) for nbytes in (*measured[name], planned[name]))]
                for name in phases]
        print_table(["phase", "measured", "largest tensor", "planner"], rows, [14, 10, 16, 10])
    end_ranks()


if __name__ == "__main__":
    main()
