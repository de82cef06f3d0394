"""keep_attention.py - each block keeps its attention output through 03's checkpoint.

A speed technique on top of 03, not a memory one. 03's recompute reruns the whole block in
backward, attention included: causal attention's forward is 1 of the 4.5 passes over S^2 that
a step makes per layer (forward 1, backward 2.5, recompute 1), so at long lengths about 22% of
the step rebuilds an output that was already computed. That output is no bigger than the block
input (Llama-3-8B, 3M tokens on 8 GPUs: 393,216 x 32 heads x 128 x 2 bytes = 3 GiB, plus its
fp32 log-sum-exp, 48 MiB), so each block keeps it with its input: on the host when 03 offloads
(31 more per GPU: 94.5 GiB), back one block ahead in backward, as the inputs come back. The
recompute then takes it instead of running the kernel, and the kernel's backward uses it with
its log-sum-exp. With offload the GPU pays one more block input's bytes (the kept output coming
back); without it every layer's output stays on the GPU (32 x 3 GiB here).

How it hooks in (all of it is here; the lessons know only base/checkpointed.py's seam,
`forward_or_kept`, which runs a forward plainly unless a keeper is installed):
  - `apply_keep_attention`, before the attention seam (02/05/06) and 03, wraps each block's
    forward; 03 then checkpoints that, so it runs in the block's forward and again in its
    recompute, and installs the block's keeper there (`KeptAttention.forward_or_kept`).
  - Seam 1's kernel becomes `attention_from_kept` (02 wraps it in its exchanges): inside a
    checkpointed block, for kernels that return their log-sum-exp, `AttentionFromKept` runs the
    kernel's forward through the seam and its backward from the kept output.
  - 05's stages and 06's ring run their own forward through the seam: 05's output and every
    stage's log-sum-exp, the ring's output and log-sum-exp are kept.
  - With offload, `Offloader` (03's, subclassed) moves the kept tensors with the block inputs.
What plan.py adds per block: support/byte_counts.py's `kept_attention_bytes`.
"""

from functools import partial

import torch

from base import checkpointed, kernels
from support.lessons import checkpointing


def apply_keep_attention(model, enabled: bool = True) -> None:
    """--keep-attention on `model`, before the attention seam (02 wraps the kernel it finds) and
    before 03's apply_checkpointing (whose recompute must rerun the forward wrapped here; with
    offload 03 takes `Offloader`). `model.kept_attention`: the KeptAttention, or None if
    disabled. Every block is wrapped; it acts only in those 03 checkpoints."""
    if hasattr(model, "checkpoint_offload"):
        raise ValueError("--keep-attention must be applied before checkpointing (03), so that the "
                         "block's recompute runs inside it")
    model.kept_attention = KeptAttention() if enabled else None
    for block in model.layers if enabled else ():
        block.forward = partial(model.kept_attention.run_block, block.forward)
        block.self_attn.core = attention_from_kept


class KeptAttention:
    """Each block's attention output and log-sum-exp(s), from its forward to its recompute: on
    the GPU, or, when 03 offloads, where the block input goes (to the host in forward, but the
    last block's; back one block ahead in backward). `stats` counts the current step (it
    restarts at block 0)."""

    def __init__(self):
        self.waiting = {}  # layer -> kept tensors (offloaded: the Offloader's HeldTensors)
        self.stats = new_stats()

    def run_block(self, forward, x, rope, cu_seqlens=None):
        """A block's forward; inside 03's checkpoint, its attention keeps its output in the
        forward and takes it back in the recompute."""
        block = checkpointed.current_block()
        # Not checkpointed (a block --checkpoint-layers leaves out: it keeps all it saved; or no
        # gradients): nothing will be recomputed, so nothing is kept here either.
        if block is None:
            return forward(x, rope, cu_seqlens)
        with checkpointed.keeping(partial(self.forward_or_kept, block)):
            return forward(x, rope, cu_seqlens)

    def forward_or_kept(self, block: checkpointed.Block, forward, *args, **kwargs) -> tuple:
        """The seam's keeper in `block`: forward's result, kept in the block's forward; in its
        recompute the kept result, forward not run."""
        if block.recomputing:
            return self.take(block)
        result = forward(*args, **kwargs)
        self.keep(block, result)
        return result

    def keep(self, block: checkpointed.Block, tensors) -> None:
        if block.layer == 0:  # a new step: what a step whose backward never ran left goes now
            self.stats = new_stats()  # (its host buffers went back with block 0's input)
            self.waiting.clear()
        # New tensor objects over the same memory: autograd gives the returned output a
        # grad_fn, and the recompute returns these again as outputs of its own node.
        tensors = tuple(t.detach() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.stats["kept"] += 1
        self.stats["kept_bytes"] += nbytes
        if block.offloader is None:
            self.waiting[block.layer] = tensors
            return
        self.waiting[block.layer] = block.offloader.hold_kept(block.layer, tensors)
        self.stats["offloaded_bytes"] += 0 if self.waiting[block.layer][0].kept else nbytes

    def take(self, block: checkpointed.Block) -> tuple:
        """The block's kept tensors on the device, in its recompute."""
        self.stats["taken"] += 1
        if block.layer not in self.waiting:
            raise RuntimeError(f"block {block.layer}'s kept attention output was already used; "
                               f"a second backward through the same graph is not supported")
        kept = self.waiting.pop(block.layer)
        if block.offloader is None:
            return kept
        self.stats["restored_bytes"] += 0 if kept[0].kept else sum(held.nbytes for held in kept)
        return block.offloader.take_kept(kept)


def new_stats() -> dict:
    """One step's counts: blocks kept and their bytes, taken back; bytes offloaded, restored."""
    return {"kept": 0, "kept_bytes": 0, "taken": 0, "offloaded_bytes": 0, "restored_bytes": 0}


class Offloader(checkpointing.BlockInputOffloader):
    """03's offloader, moving each block's kept attention tensors with its input: to the host in
    forward (but the last checkpointed block's, which stay), back when the input comes back,
    one block ahead in backward. Its events name them ("offload attention 0", ...)."""

    def __init__(self, n_checkpointed: int):
        super().__init__(n_checkpointed)
        self.kept = {}  # layer -> the HeldTensors of its kept attention, on the host

    def hold_kept(self, layer: int, tensors) -> list:
        group = [self.hold(layer, t, key=(layer, "attention", i)) for i, t in enumerate(tensors)]
        if not group[0].kept:
            self.kept[layer] = group
        self.note("keep" if group[0].kept else "offload", layer)
        return group

    def take_kept(self, group: list) -> tuple:
        """What `hold_kept` held, on the device (its block's recompute runs)."""
        if group[0].layer in self.kept:  # nobody brought it back yet
            self.bring_kept_back(group[0].layer, "fetch")
        self.note("use", group[0].layer)
        return tuple(self.hand_over(held) for held in group)

    def bring_back(self, layer: int, event: str) -> None:
        super().bring_back(layer, event)  # the block input first, then what it keeps
        if layer in self.kept:
            self.bring_kept_back(layer, event)

    def bring_kept_back(self, layer: int, event: str) -> None:
        for held in self.kept.pop(layer):
            held.prefetched = event == "prefetch"
            self.copy_back(held)
        self.note(event, layer)

    def new_step(self) -> None:
        super().new_step()
        for held in (held for group in self.kept.values() for held in group):
            self.let_go(held)
        self.kept.clear()

    def note(self, event: str, layer: int) -> None:
        self.stats["events"].append(f"{event} attention {layer}")


def attention_from_kept(q, k, v, cu_seqlens=None):
    """Seam 1's kernel under --keep-attention: inside a checkpointed block, where the kernel
    returns its log-sum-exp (not the S x S math one; not for one token), `AttentionFromKept`;
    elsewhere kernels.causal_attention."""
    if (checkpointed.current_block() is None or q.shape[1] == 1
            or kernels.lse_kernel(q)[0] == "math"):
        return kernels.causal_attention(q, k, v, cu_seqlens=cu_seqlens)
    return AttentionFromKept.apply(q, k, v, cu_seqlens)


class AttentionFromKept(torch.autograd.Function):
    """`causal_attention` through the kernels that return a log-sum-exp, its forward kept
    through 03's checkpoint: the forward runs the kernel and keeps output and log-sum-exp; the
    block's recompute takes them back (no kernel), and the backward kernel uses them. q, k, v
    are saved as usual (the recompute rebuilds them: cheap projections, Ulysses' exchange)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens):
        out, lse = checkpointed.forward_or_kept(kernels.attention_forward_lse, q, k, v,
                                                cu_seqlens=cu_seqlens)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cu_seqlens = cu_seqlens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        grads = kernels.attention_backward_lse(grad_out.contiguous(), q, k, v, out, lse,
                                               cu_seqlens=ctx.cu_seqlens)
        return (*grads, None)
