"""fused.py - SwiGLU's gate and rotary embeddings, one GPU kernel each way.

model.py writes both plainly: `swiglu_act(gate, up)` = silu(gate) * up, and `apply_rope`
(rotate-half). Run op by op, autograd launches several elementwise kernels for each, every one a
full pass over a tokens x ffn_dim (SwiGLU) or tokens x heads x head_dim (rotary) tensor: at 16K
on Llama-3.2-3B these passes and their casts took about a fifth of the step
(docs/results/prof_llama3.2-3b_1gpu_16k_auto_fa4.json). Autograd also keeps silu(gate) for the
backward, besides gate and up: one tokens x ffn_dim tensor per layer (256 MiB per layer there).

Here each is an autograd.Function over the same formula:
  SwiGLUAct  keeps gate and up only; its backward recomputes sigmoid(gate) where it needs it;
  Rotary     keeps nothing of its own: a rotation's backward is the rotation back (cos, -sin).
On CUDA each forward and each backward is one kernel that torch.compile generates from the
formula (inductor: dynamic shapes, computed in fp32 and rounded once); elsewhere the same
functions run op by op. support/build.py installs them through the model's seams (`MLP.act`,
`Attention.rotary`); 04's tiles and 05's stages call `swiglu_forward`, `swiglu_backward` and
`rotate` directly. tests/test_fused.py checks both against model.py's plain forms.
"""

import warnings

import torch
import torch.nn.functional as F

_compiled = {}  # function -> its torch.compile'd form, made on first use with CUDA tensors
_enabled = {"compile": True}


def one_kernel(fn):
    """`fn` of tensors as one kernel on CUDA (torch.compile), as written elsewhere. Where the
    compiler fails (no Triton, an inductor error), it warns once and runs `fn` as written."""
    def run(*tensors):
        if not (tensors[0].is_cuda and _enabled["compile"]):
            return fn(*tensors)
        if fn not in _compiled:
            _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return _compiled[fn](*tensors)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # a compiler failure: the formula itself still runs
            warnings.warn(f"base/fused.py: torch.compile of {fn.__name__} failed "
                          f"({type(error).__name__}: {str(error)[:200]}); running it op by op")
            _compiled[fn] = fn
            return fn(*tensors)

    run.__name__, run.__doc__ = fn.__name__, fn.__doc__
    return run


def use_compile(enabled: bool) -> None:
    """Compile on CUDA (default) or run the formulas op by op there too (tests, debugging)."""
    _enabled["compile"] = enabled


# The formulas, as model.py writes them (base/ imports no lesson; tests/test_fused.py holds the
# two equal), and SwiGLU's derivative.

@one_kernel
def swiglu_forward(gate, up):
    """model.swiglu_act: silu(gate) * up."""
    return F.silu(gate) * up


@one_kernel
def swiglu_backward(grad, gate, up):
    """(d gate, d up) of silu(gate) * up. aten's silu_backward multiplies by silu'(g) =
    s (1 + g (1 - s)), s = sigmoid(g), as autograd's SiLU does (op by op: four kernels)."""
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


@one_kernel
def rotate(x, cos, sin):
    """model.apply_rope: rotate-half rotary on x (B, S, heads, D), cos/sin (B, S, D // 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLUAct(torch.autograd.Function):
    """model.swiglu_act, keeping its two inputs for backward and nothing else."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        return swiglu_backward(grad, gate, up)


class Rotary(torch.autograd.Function):
    """model.apply_rope; its backward rotates the gradient back (the tables need none)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None


def swiglu(gate, up):
    """The MLP's seam: silu(gate) * up."""
    return SwiGLUAct.apply(gate, up)


def rotary(x, cos, sin):
    """The attention's rotary seam: apply_rope(x, cos, sin)."""
    return Rotary.apply(x, cos, sin)


def use_fused(transformer) -> None:
    """Every block's MLP activation and rotary run through this file's functions."""
    for block in transformer.layers:
        block.mlp.act = swiglu
        block.self_attn.rotary = rotary
