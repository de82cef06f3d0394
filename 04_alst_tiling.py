"""04 - Arctic Long Sequence Training (ALST) tiling: the MLP and the loss, a slice at a time.

The memory problem. After 01-03, Llama-3-8B at 3M tokens on 8 GPUs gives each GPU 393,216
tokens, and the largest allocations left are temporaries of per-token operations over the whole
local sequence:
  - the MLP, down(silu(gate(x)) * up(x)), keeps four tokens x 14,336 intermediates for backward
    (10.5 GiB each in bf16: 42 GiB per layer, six of them, 63 GiB, at once inside its backward);
  - the loss needs the logits, tokens x 128,256 vocabulary entries in fp32: 188 GiB, and its
    log-softmax and gradient as much again.

The idea. Both are independent per token: cut the local sequence into tiles and compute one tile
at a time. Forward runs each tile without autograd and keeps only the input; backward recomputes
one tile at a time with autograd on, writes that tile's input gradient and adds the weight
gradients up across tiles, returning them once (FSDP2 then reduce-scatters each once). A
4,096-token MLP tile holds 0.44 GiB, a 2,092-token loss tile 1 GiB of fp32 logits. The price is
one more forward of the MLP and lm_head per step; under 03's checkpointing the tiled MLP skips its
output in the block's recompute (nothing there reads it), so the MLP still runs forward twice.

`TiledMLP` below is the idea in its plainest form; `SequenceTiledRecompute` is the same loop
made general (labels cut with the tokens, per-tile sums for the loss, the recompute skip), and
serves the MLP, the RMSNorms (`--tile-norm`: where they run op by op, in fp32) and the loss.
Every rank cuts the same number of tiles (sizes follow shapes only): where tiles call
collectives, a rank with fewer tiles deadlocks the others.

Run the demo (peak memory of one MLP and of the loss, untiled vs tiled):

    python 04_alst_tiling.py                                   # CPU: small model, 16K tokens
    torchrun --nproc-per-node 2 04_alst_tiling.py --model llama3-8b --seq-len 128K   # GPUs
"""

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F

from model import IGNORE_INDEX, rms_norm
from support import checkpointed  # is_recomputing: 03 marks its recompute

GiB = 2**30
MAX_LOSS_TILE_LOGIT_BYTES = GiB  # default loss tile: at most this many bytes of fp32 logits


# The idea, plainly: the MLP over tiles of tokens, recomputed tile by tile in backward.

def swiglu(x, gate_weight, up_weight, down_weight):
    """model.MLP's formula, down(silu(gate(x)) * up(x)), with its weights as arguments."""
    return F.linear(F.silu(F.linear(x, gate_weight)) * F.linear(x, up_weight), down_weight)


class TiledMLP(torch.autograd.Function):
    """swiglu(x, *weights) for x (tokens, dim), `tile_tokens` tokens at a time. Kept for the
    reader, and as the tests' reference for the general version below."""

    @staticmethod
    def forward(ctx, x, tile_tokens: int, *weights):
        ctx.save_for_backward(x, *weights)  # the input only: no tile's intermediates survive
        ctx.tile_tokens = tile_tokens
        out = torch.empty_like(x)
        for tile in token_tiles(x.shape[0], tile_tokens):
            out[tile] = swiglu(x[tile], *weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, *weights = ctx.saved_tensors
        weights = [w.detach().requires_grad_() for w in weights]
        grad_x = torch.empty_like(x)
        weight_grads = [torch.zeros_like(w, dtype=torch.float32) for w in weights]
        for tile in token_tiles(x.shape[0], ctx.tile_tokens):
            x_tile = x[tile].detach().requires_grad_()
            with torch.enable_grad():  # this tile's intermediates, and only this tile's
                out = swiglu(x_tile, *weights)
            grad_x[tile], *grads = torch.autograd.grad(out, [x_tile, *weights], grad_out[tile])
            for total, grad in zip(weight_grads, grads):
                total += grad  # added up in fp32, handed to FSDP once
        return grad_x, None, *(g.to(w.dtype) for g, w in zip(weight_grads, weights))


def token_tiles(n_tokens: int, tile_tokens: int) -> list[slice]:
    """Consecutive slices of `tile_tokens` tokens; the last is shorter when they don't divide."""
    return [slice(start, min(start + tile_tokens, n_tokens))
            for start in range(0, n_tokens, tile_tokens)]


# The same loop made general: token arguments (labels), per-tile sums (the loss), the recompute
# skip. Each tile's weight gradient is rounded once, the fp32 sum once at the end.

@dataclass(frozen=True)
class Tiling:
    """How SequenceTiledRecompute cuts and runs `fn` (its non-tensor arguments, named)."""
    fn: Callable              # fn(x_tile, *token_arg_tiles, *weights)
    tile_tokens: int
    sum_tiles: bool           # False: fn returns one row per token; True: a scalar per tile
    skip_in_recompute: bool   # see forward
    n_token_args: int         # how many of the tensors after x are cut into tiles (labels)


class SequenceTiledRecompute(torch.autograd.Function):
    """fn(x, *token_args, *weights) over tokens (dim 0), `tile_tokens` tokens at a time.

    x: (tokens, ...) differentiable input; token_args: tensors cut into the same tiles but not
    differentiated (labels); weights: used whole by every tile, read by the caller at call time
    (under FSDP2 they are the block's gathered parameters). sum_tiles=False: the tiles' rows are
    written into one output buffer; sum_tiles=True: the tiles' scalars are added.
    """

    @staticmethod
    def forward(ctx, tiling: Tiling, x, *tensors):
        token_args, weights = tensors[:tiling.n_token_args], tensors[tiling.n_token_args:]
        ctx.tiling = tiling
        # Only the input, labels and weights: nothing per tile survives the forward.
        ctx.save_for_backward(x, *tensors)
        if tiling.skip_in_recompute and checkpointed.is_recomputing():
            # In 03's recompute the block is rerun only to rebuild what its ops save; this output
            # (same shape as x) feeds nothing but the residual add that ends the block, and our
            # backward recomputes every tile anyway: computing it here would be a third forward.
            return torch.empty_like(x)
        out = None
        for tile in token_tiles(x.shape[0], tiling.tile_tokens):  # autograd is off in forward
            piece = tiling.fn(x[tile], *(t[tile] for t in token_args), *weights)
            if tiling.sum_tiles:
                out = piece if out is None else out + piece
            else:
                if out is None:
                    out = piece.new_empty((x.shape[0], *piece.shape[1:]))
                out[tile] = piece
        return out

    @staticmethod
    def backward(ctx, grad_out):
        tiling = ctx.tiling
        x, *tensors = ctx.saved_tensors
        token_args, weights = tensors[:tiling.n_token_args], tensors[tiling.n_token_args:]
        _, x_needs_grad, *tensors_need_grad = ctx.needs_input_grad
        weight_needs_grad = tensors_need_grad[tiling.n_token_args:]
        # Fresh leaves, so each tile's graph ends here and autograd.grad returns the pieces.
        weight_leaves = [w.detach().requires_grad_(need)
                         for w, need in zip(weights, weight_needs_grad)]
        wanted_weights = [w for w in weight_leaves if w.requires_grad]
        grad_x = torch.empty_like(x) if x_needs_grad else None
        # Weight gradients are added up in fp32: in bf16 every one of a hundred additions
        # would round again. Each tile's gradient is rounded once, the sum once at the end.
        # This costs a transient fp32 copy of each weight (2 GiB for Llama-3-8B's lm_head).
        weight_grad_sums = [None] * len(wanted_weights)
        for tile in token_tiles(x.shape[0], tiling.tile_tokens):
            if grad_x is None and not wanted_weights:
                break
            x_tile = x[tile].detach().requires_grad_(x_needs_grad)
            with torch.enable_grad():
                piece = tiling.fn(x_tile, *(t[tile] for t in token_args), *weight_leaves)
            wanted = ([x_tile] if x_needs_grad else []) + wanted_weights
            grad_piece = grad_out if tiling.sum_tiles else grad_out[tile]
            grads = list(torch.autograd.grad(piece, wanted, grad_piece))
            if x_needs_grad:
                grad_x[tile] = grads.pop(0)
            for i, grad in enumerate(grads):
                if weight_grad_sums[i] is None:
                    weight_grad_sums[i] = grad.float()  # fp32 weights: no copy
                else:
                    weight_grad_sums[i] += grad
        sums = iter(weight_grad_sums)
        weight_grads = [next(sums).to(w.dtype) if w.requires_grad else None for w in weight_leaves]
        return (None, grad_x, *([None] * tiling.n_token_args), *weight_grads)


def tiled_over_tokens(fn, x, token_args, weights, tile_tokens: int, sum_tiles: bool,
                      skip_in_recompute: bool = False):
    """SequenceTiledRecompute with its arguments named (autograd's apply takes positions only)."""
    tiling = Tiling(fn, tile_tokens, sum_tiles, skip_in_recompute, len(token_args))
    return SequenceTiledRecompute.apply(tiling, x, *token_args, *weights)


# --- Seam 3: the MLP ---------------------------------------------------------------------------

def tiled_mlp_forward(mlp, x: torch.Tensor, tile_tokens: int | None = None) -> torch.Tensor:
    """model.MLP.forward, computed `tile_tokens` tokens at a time (batch and sequence together)."""
    tokens = x.reshape(-1, x.shape[-1])
    tile = mlp_tile_size(x.shape[-1], tokens.shape[0], tile_tokens)
    weights = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)  # read now: FSDP
    # The MLP is the last op of a block: in 03's recompute its output is not needed (see above).
    return tiled_over_tokens(swiglu, tokens, (), weights, tile, sum_tiles=False,
                             skip_in_recompute=True).view(x.shape)


# --- Seam 4: the blocks' RMSNorms, per token as well ------------------------------------------

def tiled_norm_forward(norm, x: torch.Tensor, tile_tokens: int | None = None) -> torch.Tensor:
    """model.RMSNorm.forward `tile_tokens` tokens at a time. The norm computes in fp32. Where it
    runs op by op (F.rms_norm off CUDA) and untiled, it keeps an fp32 copy of the whole local
    sequence for backward and its backward holds six (24 x dim bytes per token: 36 GiB for
    Llama-3-8B at 393,216 tokens per GPU, the largest buffer left once the MLP and the loss are
    tiled). Tiled, they exist for one tile at a time; what stays is the input, which the residual
    stream holds anyway. On CUDA F.rms_norm is one fused kernel whose fp32 values never leave it:
    it keeps what the tiled norm keeps, and tiling it only adds a recompute."""
    tokens = x.reshape(-1, x.shape[-1])
    tile = mlp_tile_size(x.shape[-1], tokens.shape[0], tile_tokens)
    return tiled_over_tokens(partial(rms_norm, eps=norm.eps), tokens, (), (norm.weight,), tile,
                             sum_tiles=False).view(x.shape)


# --- Seam 5: final norm + lm_head + cross-entropy ----------------------------------------------

def norm_lm_head_loss(h, labels, norm_weight, lm_head_weight, *, eps: float):
    """model.Transformer.loss_sum's formula with its weights as arguments: fp32 logits, the
    cross-entropy summed over non-ignored labels (0, not NaN, when every label is ignored)."""
    logits = F.linear(rms_norm(h, norm_weight, eps), lm_head_weight).float()
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_loss_sum(model, h: torch.Tensor, labels: torch.Tensor, tile_tokens: int | None = None):
    """model.Transformer.loss_sum, computed `tile_tokens` tokens at a time: logits of all tokens
    never exist at once."""
    tokens, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    weights = (model.norm.weight, model.lm_head.weight)  # read now: FSDP
    tile = loss_tile_size(weights[1].shape[0], tokens.shape[0], tile_tokens)
    loss_fn = partial(norm_lm_head_loss, eps=model.norm.eps)
    return tiled_over_tokens(loss_fn, tokens, (flat_labels,), weights, tile, sum_tiles=True)


def apply_tiling(model, tile_mlp: bool = True, tile_loss: bool = True,
                 mlp_tile_tokens: int | None = None, loss_tile_tokens: int | None = None,
                 tile_norm: bool = False) -> None:
    """Replace every block's MLP forward, its two RMSNorms' forwards and/or the model's
    loss_sum with their tiled versions (norm tiles are as long as MLP tiles; eval.py tiles the
    loss's per-token sibling, token_scores, the same way).

    Only forward functions are replaced (on the instances; parameter names are unchanged) and
    no parameter is captured, so this works on the meta device before checkpointing and FSDP.
    Tile sizes: tokens per tile, or None for the shape-derived defaults above.
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
    mlp, generator = model.layers[0].mlp, torch.Generator().manual_seed(0)
    labels = torch.randint(0, args.vocab_size, (1, n), generator=generator).to(demo.device)
    phases = {"MLP untiled": lambda x: type(mlp).forward(mlp, x),
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
