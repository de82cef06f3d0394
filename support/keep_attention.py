"""keep_attention.py - each block keeps its attention output through its checkpoint (--keep-attention).

A speed technique on top of 03, not a memory one. 03's recompute reruns the whole block in
backward, attention included: causal attention's forward is 1 of the 4.5 passes over S^2 that
a step makes per layer (forward 1, backward 2.5, recompute 1), so at long lengths about 22% of
the step rebuilds an output that was already computed. That output is no bigger than the block
input (Llama-3-8B, 3M tokens on 8 GPUs: 393,216 x 32 heads x 128 x 2 bytes = 3 GiB, plus its
fp32 log-sum-exp, 48 MiB), so each block keeps it with its input: on the host when 03 offloads
(31 more per GPU: 94.5 GiB), back one block ahead in backward, as the inputs come back. The
recompute then takes it instead of running the kernel, and the kernel's backward uses it with
its log-sum-exp. With offload the GPU pays one more block input's bytes (the kept output coming
back); without it every layer's output stays on the GPU (32 x 3 GiB here). On one H200 a step
at 512K-1M tokens runs 1.23x faster with it.

How it hooks in (this file imports kernels.py, and 05 imports it; 03 and kernels.py only call
what they are handed):
  - train.py hands a `KeptAttention()` to 03's `apply_checkpointing(..., keep_attention=)`.
    03 runs its `in_block(layer, recomputing)` around each block's forward and recompute (the
    checkpoint's context_fn), sets its `offloader` when offloading, and calls its `prefetch`.
  - Inside a block, `in_block` stands in for kernels.causal_attention (the plain model's and
    02's kernel) with `AttentionFromKept`, for the kernels that return a log-sum-exp.
  - 05 runs its own stages and backward: it asks `current_block()` and keeps its output buffer
    and every stage's log-sum-exp itself.
What plan.py adds per block: support/byte_counts.py's `kept_attention_bytes`.
"""

import contextlib
import contextvars
from dataclasses import dataclass

import torch

from support import kernels


class KeptAttention:
    """Each block's attention output and log-sum-exp(s), from its forward to its recompute.

    Without offload they wait on the GPU; with it (`offloader`, set by 03) they go where the
    block input goes: to the host in forward (the last block's stay), back one block ahead in
    backward. `stats` counts the current step (it restarts at block 0)."""

    def __init__(self):
        self.offloader = None  # 03's BlockInputOffloader, when 03 offloads
        self.waiting = {}      # layer -> kept tensors (offloaded: the offloader's SavedBlockInputs)
        self.stats = new_stats()

    @contextlib.contextmanager
    def in_block(self, layer: int, recomputing: bool):
        """Around block `layer`'s forward or its recompute: the attention inside keeps its
        output here, or takes it back."""
        block = BlockAttention(self, layer, recomputing)
        token = _block.set(block)
        try:
            with kernels.standing_in(block.causal_attention):
                yield
        finally:
            _block.reset(token)

    def keep(self, layer: int, tensors) -> None:
        if layer == 0:  # a new step: what a step whose backward never ran left goes now
            self.stats = new_stats()
            self.forget_unfinished_step()
        # New tensor objects over the same memory: autograd gives the returned output a
        # grad_fn, and the recompute returns these again as outputs of its own node.
        tensors = tuple(t.detach() for t in tensors)
        self.stats["kept"] += 1
        self.stats["kept_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        if self.offloader is None:
            self.waiting[layer] = tensors
            return
        saved = [self.offloader.hold(layer, t, pool=(layer, i)) for i, t in enumerate(tensors)]
        self.waiting[layer] = saved
        if saved[0].kept:
            self.log("keep attention", layer)
        else:
            self.stats["offloaded_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
            self.log("offload attention", layer)

    def prefetch(self, layer: int) -> None:
        """03's offloader, as block layer + 1's input is used: bring block `layer`'s back."""
        saved = self.waiting.get(layer)
        if saved and saved[0].host is not None:
            self.copy_back(saved)
            self.log("prefetch attention", layer)

    def take(self, layer: int) -> tuple:
        """The block's kept tensors on the device, in its recompute."""
        self.stats["taken"] += 1
        if layer not in self.waiting:
            raise RuntimeError(f"block {layer}'s kept attention output was already used; a "
                               f"second backward through the same graph is not supported")
        kept = self.waiting.pop(layer)
        if self.offloader is None:
            return kept
        if kept[0].host is not None:  # not prefetched: fetch them now
            self.copy_back(kept)
            self.log("fetch attention", layer)
        tensors = tuple(self.offloader.hand_over(one) for one in kept)
        self.log("use attention", layer)
        return tensors

    def copy_back(self, saved: list) -> None:
        for one in saved:
            self.stats["restored_bytes"] += one.host.nbytes
            self.offloader.copy_back(one)

    def forget_unfinished_step(self) -> None:
        """Kept tensors of a step whose backward never ran: host buffers back to their pools."""
        if self.offloader is not None:
            for saved in self.waiting.values():
                for one in saved:
                    self.offloader.let_go(one)
        self.waiting.clear()

    def log(self, event: str, layer: int) -> None:
        """Into the offloader's event log, in order with the block inputs' events."""
        self.offloader.stats["events"].append(f"{event} {layer}")


def new_stats() -> dict:
    """One step's counts: blocks kept and their bytes, taken back; bytes offloaded, restored."""
    return {"kept": 0, "kept_bytes": 0, "taken": 0, "offloaded_bytes": 0, "restored_bytes": 0}


# Which checkpointed block the attention runs in (None outside one, or without --keep-attention).
_block = contextvars.ContextVar("kept_attention_block", default=None)


def current_block() -> "BlockAttention | None":
    return _block.get()


@dataclass
class BlockAttention:
    """What the attention sees of `KeptAttention` inside one checkpointed block."""
    kept: KeptAttention
    layer: int
    recomputing: bool

    def keep(self, tensors) -> None:
        self.kept.keep(self.layer, tensors)

    def take(self) -> tuple:
        return self.kept.take(self.layer)

    def causal_attention(self, q, k, v, cu_seqlens=None):
        """kernels.causal_attention inside this block (`kernels.standing_in`)."""
        return AttentionFromKept.apply(q, k, v, cu_seqlens, self)


class AttentionFromKept(torch.autograd.Function):
    """`causal_attention` whose output and log-sum-exp are kept through 03's checkpoint: the
    forward runs the kernel and keeps them; the block's recompute in backward takes them back
    (no kernel), and the backward kernel uses them. q, k, v are saved as usual (the recompute
    rebuilds them: cheap projections, Ulysses' exchange)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, block: BlockAttention):
        if block.recomputing:
            out, lse = block.take()
        else:
            out, lse = kernels.attention_forward_lse(q, k, v, cu_seqlens=cu_seqlens)
            block.keep((out, lse))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens = cu_seqlens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = kernels.attention_backward_lse(grad_out.contiguous(), q, k, v, out, lse,
                                               cu_seqlens=ctx.cu_seqlens)
        return (*grads, None, None)
