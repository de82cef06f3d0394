"""fused.py - SwiGLU's gate, rotary embeddings and the loss's cross-entropy, fused on the GPU.

model.py writes both plainly: `swiglu_act(gate, up)` = silu(gate) * up, and `apply_rope`
(rotate-half). Run op by op, autograd launches several elementwise kernels for each, every one a
full pass over a tokens x ffn_dim (SwiGLU) or tokens x heads x head_dim (rotary) tensor: at 16K
on Llama-3.2-3B 29% of a step ran outside matmul and attention, its largest part their
multiplications, 41 of 913 ms (docs/results/prof_llama3.2-3b_1gpu_16k_auto_fa4.json). Autograd
also keeps silu(gate) and down_proj's input, silu(gate) * up, for the backward, besides gate and
up: two tokens x ffn_dim tensors per layer more (2 x 256 MiB per layer there, 2 x 448 MiB at
16K on Llama-3-8B), which decide how many blocks 03 must checkpoint where a step is short.

The loss is the largest of them: model.py's cross-entropy casts the tokens x vocab logits to
fp32 and autograd keeps their log-softmax (fp32) for backward, whose gradient is fp32 again:
12 bytes per logit at its peak, 24 GiB at 16K on Llama-3.2-3B (a 128,256-entry vocabulary),
and a dozen passes over them (04's tiles, by hand, make the same passes tile by tile).

Here each is an autograd.Function over the same formula:
  SwiGLUDown    down_proj(silu(gate) * up), keeping gate and up only: its backward computes
                silu(gate) * up again for down_proj's weight gradient (one kernel) and
                sigmoid(gate) where it needs it; in 03's recompute it skips down_proj (nothing
                there reads the block's output), so a checkpointed block runs gate and up
                twice and down_proj once, as 04's tiled MLP does;
  Rotary        keeps nothing of its own: a rotation's backward is the rotation back (sin negated);
  CrossEntropy  keeps the logits in their own dtype (bf16: 2 bytes each) and the labels; its
                backward recomputes each row's log-sum-exp and writes the gradient in that dtype
                (4 bytes per logit at the peak, the logits and their gradient). The statistics
                are fp32, as model.py's, from the same bf16 logits. Evaluation's per-token
                scores (`logit_scores`, no autograd) read the bf16 logits the same way.
On CUDA each forward and each backward is one kernel that torch.compile generates from the
formula (inductor: the token dims dynamic, the model's widths fixed; computed in fp32 and
rounded once); elsewhere they run op by op, in place where that holds fewer tensors at once.
support/build.py installs them through the model's seams (`MLP.forward`, `Attention.rotary`,
`Transformer.cross_entropy`, `Transformer.logit_scores`); 04's tiles and 05's stages call
`swiglu_forward`, `swiglu_backward`, `rotate`, `rotate_back`, `cross_entropy_sum` and
`cross_entropy_backward` directly; eval.py's tiles call the model's `logit_scores`.
tests/test_fused.py checks them against model.py's forms.
"""

import warnings
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from base import checkpointed  # is_recomputing: 03 marks its recompute

_compiled = {}  # function -> its torch.compile'd form, made on first use with CUDA tensors
_warned = set()


def one_kernel(formula, op_by_op=None):
    """`formula` of tensors as one kernel on CUDA (torch.compile); elsewhere `op_by_op` (the
    same function with the fewest temporaries, default the formula itself). Where the compiler
    fails (no Triton, an inductor error, more variants than dynamo keeps), that call runs op by
    op, with a warning once per function; an out-of-memory error is the step's."""
    op_by_op = op_by_op or formula

    def run(*tensors):
        # Under a dispatch mode (an op counter, a memory probe) dynamo compiles nothing, and on
        # torch 2.11 the frame then stayed uncompiled for the rest of the process (seen on an
        # H200: tests/test_04's op counter ran first, test_fused then saw two kernels): such a
        # caller wants the ATen ops anyway.
        if not tensors[0].is_cuda or is_in_torch_dispatch_mode(include_infra_modes=False):
            return op_by_op(*tensors)
        if formula not in _compiled:
            _compiled[formula] = torch.compile(formula, dynamic=False, fullgraph=True)
        # detached: every call site runs without autograd (inside an autograd.Function), and
        # dynamo compiles again for each requires_grad it meets
        inputs = [t.detach() for t in tensors]
        # The token dims vary from call to call: batch and sequence (the leading two, never the
        # last), a token tensor's one (labels); the widths (heads, head_dim, ffn_dim, vocab)
        # stay constants of the kernel: one compile per width, rank, dtype and layout, one or
        # two of each form in a run (past dynamo's recompile_limit of 8 torch 2.14 raises, and
        # that call runs op by op with the warning below). With every dim dynamic the index
        # arithmetic divided by runtime sizes: rotary moved ~0.55 TB/s on an H200 at cd93a34
        # (q and k of a layer, 268 MB, in 0.49 ms at 16K on Llama-3.2-3B), a ninth of the
        # memory's speed.
        for t in inputs:
            for dim in range(1 if t.dim() == 1 else min(2, t.dim() - 1)):
                torch._dynamo.maybe_mark_dynamic(t, dim)
        try:
            return _compiled[formula](*inputs)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # a compiler failure: the formula itself still runs
            if formula not in _warned:
                _warned.add(formula)
                warnings.warn(f"base/fused.py: torch.compile of {formula.__name__} failed "
                              f"({type(error).__name__}: {str(error)[:200]}); running it op "
                              f"by op")
            return op_by_op(*tensors)

    run.__name__, run.__doc__ = formula.__name__, formula.__doc__
    return run


# The formulas, as model.py writes them (base/ imports no lesson; tests/test_fused.py holds the
# two equal), SwiGLU's derivative, and the op-by-op forms that hold no more tensors at once than
# the planner counts (support/byte_counts.py: three tokens x ffn_dim forward, five backward).

def _swiglu(gate, up):
    """model.swiglu_act: silu(gate) * up."""
    return F.silu(gate) * up


def _swiglu_backward(grad, gate, up):
    """(d gate, d up) of silu(gate) * up. aten's silu_backward multiplies by silu'(g) =
    s (1 + g (1 - s)), s = sigmoid(g), as autograd's SiLU does."""
    return torch.ops.aten.silu_backward(grad * up, gate), grad * F.silu(gate)


def _swiglu_in_place(gate, up):
    return F.silu(gate).mul_(up)


def _swiglu_backward_in_place(grad, gate, up):
    grad_up = F.silu(gate).mul_(grad)
    grad_gate = grad * up
    return torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate), grad_up


def _rotate(x, cos, sin):
    """model.apply_rope: rotate-half rotary on x (B, S, heads, D), cos/sin (B, S, D // 2)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotate_back(x, cos, sin):
    """_rotate by the opposite angle, a rotation's backward (compiled, the negation is in the
    same kernel)."""
    return _rotate(x, cos, -sin)


IGNORE_INDEX = -100  # model.IGNORE_INDEX (base/ imports nothing above it): a label counting 0


def at_least_fp32(t):
    """t in fp32 where it is narrower (bf16 logits), as it is otherwise (fp32, float64)."""
    return t.to(fp32_or_wider(t.dtype))


def fp32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """fp32 for a narrower dtype (bf16), else `dtype` itself (fp32, float64)."""
    return torch.promote_types(dtype, torch.float32)


def _cross_entropy_sum(logits, labels):
    """model.cross_entropy_sum: the cross-entropy of fp32 logits, summed over the counted rows
    (logits (tokens, vocab), labels (tokens,)). Compiled: one pass over the logits for the
    log-sum-exp, the label's logit read where it is; nothing tokens x vocab is written."""
    x = at_least_fp32(logits)
    picked = x.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    return ((torch.logsumexp(x, dim=1) - picked) * (labels != IGNORE_INDEX)).sum()


def _logit_scores(logits, labels):
    """model.logit_scores (evaluation's per-token loss and argmax), one pass over the logits:
    nothing tokens x vocab is written, the bf16 logits are all it holds (2 bytes per logit)."""
    x = at_least_fp32(logits)
    picked = x.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    losses = (torch.logsumexp(x, dim=1) - picked) * (labels != IGNORE_INDEX)
    return torch.stack((losses, x.argmax(dim=1).float()), dim=1)


def _cross_entropy_backward(logits, labels, grad_loss):
    """grad_loss x d(_cross_entropy_sum) / d logits, in the logits' dtype: softmax(row) -
    one_hot(label) on the counted rows, 0 on the ignored (never NaN, also when all are)."""
    x = at_least_fp32(logits)
    probs = torch.exp(x - torch.logsumexp(x, dim=1, keepdim=True))
    one_hot = (torch.arange(x.shape[1], device=x.device) == labels[:, None]).to(x.dtype)
    counted = (labels != IGNORE_INDEX)[:, None]
    return ((probs - one_hot) * (counted * grad_loss)).to(logits.dtype)


def _cross_entropy_backward_in_place(logits, labels, grad_loss):
    """The same with one fp32 logits-sized tensor (04's tiles' count, support/byte_counts.py)."""
    # dtype=: the softmax reads the bf16 logits itself, no fp32 copy of them beside its output
    probs = torch.softmax(logits, dim=1, dtype=fp32_or_wider(logits.dtype))
    rows = torch.arange(len(labels), device=labels.device)
    probs[rows, labels.clamp(min=0)] -= 1  # an ignored row's column is zeroed below
    return probs.mul_((labels != IGNORE_INDEX)[:, None] * grad_loss).to(logits.dtype)


swiglu_forward = one_kernel(_swiglu, _swiglu_in_place)
swiglu_backward = one_kernel(_swiglu_backward, _swiglu_backward_in_place)
rotate = one_kernel(_rotate)
rotate_back = one_kernel(_rotate_back)
cross_entropy_sum = one_kernel(_cross_entropy_sum)
cross_entropy_backward = one_kernel(_cross_entropy_backward, _cross_entropy_backward_in_place)
logit_scores = one_kernel(_logit_scores)


class SwiGLUDown(torch.autograd.Function):
    """down_proj(model.swiglu_act(gate, up)), keeping gate and up for backward and nothing else:
    down_proj's input, silu(gate) * up, is computed again in backward for its weight's gradient
    (one elementwise kernel) where autograd's Linear would keep it from forward to backward."""

    @staticmethod
    def forward(ctx, gate, up, weight):
        ctx.save_for_backward(gate, up, weight)
        if checkpointed.is_recomputing():
            # 03's recompute reruns the block only to rebuild what its ops save: this output
            # feeds nothing there but the residual add that ends the block (04's tiled MLP
            # skips its own the same way); computing it would be a third of the MLP's forward
            return gate.new_empty(*gate.shape[:-1], weight.shape[0])
        return F.linear(swiglu_forward(gate, up), weight)

    @staticmethod
    def backward(ctx, grad):
        gate, up, weight = ctx.saved_tensors
        grad_weight = None
        if ctx.needs_input_grad[2]:  # (dim, ffn_dim): summed over every token
            act = swiglu_forward(gate, up)
            grad_weight = grad.flatten(0, -2).t() @ act.flatten(0, -2)
            del act  # before the two gradients below exist
        if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            return None, None, grad_weight
        grad_gate, grad_up = swiglu_backward(grad @ weight, gate, up)
        return grad_gate, grad_up, grad_weight


class Rotary(torch.autograd.Function):
    """model.apply_rope; its backward rotates the gradient back (the tables need none)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rotate_back(grad, cos, sin), None, None


class CrossEntropy(torch.autograd.Function):
    """model.cross_entropy_sum over (tokens, vocab) logits, keeping them in their own dtype."""

    @staticmethod
    def forward(ctx, logits, labels):
        ctx.save_for_backward(logits, labels)
        return cross_entropy_sum(logits, labels)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, labels = ctx.saved_tensors
        return cross_entropy_backward(logits, labels, grad_loss), None


def mlp_forward(mlp, x):
    """The MLP's seam (model.MLP.forward): down_proj(silu(gate_proj(x)) * up_proj(x))."""
    return SwiGLUDown.apply(mlp.gate_proj(x), mlp.up_proj(x), mlp.down_proj.weight)


def rotary(x, cos, sin):
    """The attention's rotary seam: apply_rope(x, cos, sin)."""
    return Rotary.apply(x, cos, sin)


def cross_entropy(logits, labels):
    """The loss's seam: the cross-entropy of (tokens, vocab) logits, summed over counted rows."""
    return CrossEntropy.apply(logits, labels)


def use_fused(transformer) -> None:
    """Every block's MLP and rotary, and the loss's cross-entropy and evaluation's per-token
    scores, run through this file's functions (04's tiles replace the MLP's forward again)."""
    transformer.cross_entropy = cross_entropy
    transformer.logit_scores = logit_scores
    for block in transformer.layers:
        block.mlp.forward = partial(mlp_forward, block.mlp)
        block.self_attn.rotary = rotary
