"""03 - Activation checkpointing, then offloading the checkpoints to CPU memory.

The memory problem. After FSDP (01) and Ulysses (02), Llama-3-8B at 3M tokens on 8 GPUs gives
each GPU 393,216 tokens, and backward still needs what every layer saved in forward: about
196 KiB per token per layer in bf16 (the norms' fp32 inputs, q/k/v and the attention output,
four x 14,336 MLP intermediates per token; counted with a saved-tensors hook on one block), so
393,216 x 196 KiB x 32 layers = 2,357 GiB per GPU.

The idea, in two steps (and a third that buys speed back with host memory).
  1. Checkpointing: keep only each block's input, and run the block's forward again in backward,
     just before its own backward, to rebuild what it saved. One block's activations exist at a
     time; what stays for backward is 32 block inputs of 393,216 x 4,096 x 2 bytes = 3 GiB each:
     96 GiB per GPU, still more than an 80 GiB H100 holds next to 15 GiB of model state.
  2. Offloading the checkpoints: copy each block input into pinned host memory as soon as the
     block has it, and bring it back just before that block's backward. Between forward and
     backward the GPU keeps only the last block's input (backward starts there, so copying it
     out would only make backward wait): 3 GiB; during backward two at a time, the one the
     current block recomputes from and the next one coming back: 6 GiB, the same for 4 layers
     or 80. The host holds 31 block inputs per GPU: 93 GiB. PyTorch's pinned allocator rounds
     every buffer up to a power of two (one 3 GiB buffer takes 4 GiB: 124 GiB per GPU), so each
     block input is kept in power-of-two pieces instead, 2 GiB + 1 GiB, which take 3.

The copies must not slow training down. They run on a side CUDA stream: in forward the side
stream waits only for the block input to be computed and copies it out while the compute stream
runs the next block; in backward, when block i's input is unpacked, block i-1's input starts
coming back, so its copy overlaps block i's recompute and backward (pinned memory copies at
~55 GB/s on an H200: a 3 GiB input in ~60 ms, against tens of seconds of attention per block
at these lengths). Host buffers are allocated once per layer and reused every step.

The engine is PyTorch's: `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` saves
the block's inputs through the saved-tensors mechanism, outside the region it recomputes, so a
`torch.autograd.graph.saved_tensors_hooks(pack, unpack)` placed around the checkpoint call sees
exactly the block's inputs and nothing inside the block. `pack` moves the hidden state to the
host and returns a small handle; `unpack` returns it on the GPU. The GPU copy is freed only when
nothing references it any more: autograd keeps the hooks alive with the graph, so `pack` may
hold the input weakly only (a strong reference would keep every offloaded input on the GPU).
Under FSDP2 (applied after this, one `fully_shard` per block) FSDP's hooks gather the block's parameters around the
replaced forward, and the recompute in backward runs while they are gathered for backward.

A third step trades host memory back for time (`--keep-attention`, off by default). The
recompute reruns the whole block, attention included: causal attention's forward is 1 of the
4.5 passes over S^2 that a step makes per layer (forward 1, backward 2.5, recompute 1), so at
long lengths about 22% of the step goes to rebuilding an output that was already computed. Its
output is no bigger than the block input (393,216 x 32 heads x 128 x 2 bytes = 3 GiB, plus its
fp32 log-sum-exp, 48 MiB), so each block keeps it too, with its input: on the host when
offloading (31 more per GPU: 94.5 GiB; 1.5 TiB for inputs and outputs of an 8-GPU node), and
back one block ahead in backward. The recompute then takes it instead of running the kernel,
and the kernel's backward uses it with the log-sum-exp (kernels.py's `AttentionFromKept`; 05
keeps its output buffer and stage log-sum-exps). `checkpoint`'s `context_fn` tells the
attention which block it runs in and whether this is the recompute. With offload the GPU pays
one more block input's bytes (the kept output coming back); without it every layer's output
stays on the GPU (32 x 3 GiB here). On one H200 the step at 512K-1M is 1.23x faster (README).

Run the demo (memory vs number of layers: none / checkpoint / checkpoint + offload):

    python 03_checkpoint_offload.py                       # CPU: small model, bytes kept
    torchrun --nproc-per-node 2 03_checkpoint_offload.py  # CPU/gloo or GPUs: FSDP + Ulysses
    torchrun --nproc-per-node 2 03_checkpoint_offload.py --model llama3-8b --seq-len 32K \
        --layers 2 4 8                                    # GPUs: the defaults there
"""

import argparse
import contextlib
import contextvars
import gc
import importlib
import weakref
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from support import kernels

GiB, MiB = 2**30, 2**20


# ---------------------------------------------------------------------------------------------
# What this file removes, in bytes (plan.py adds these up).
# ---------------------------------------------------------------------------------------------

def checkpoint_memory_bytes(args, seq_len: int, sp: int, offload: bool,
                            bytes_per_value: int = 2, pinned: bool = False,
                            keep_attention: bool = False) -> dict:
    """Per-rank bytes of saved block inputs between forward and backward: {"gpu", "host"}.

    Each block input is local tokens x dim. Without offload all n_layers stay on the GPU; with
    offload only the last block's does, and n_layers - 1 live in pinned host memory. (During
    backward the GPU holds two at a time: the one the current block recomputes from and the next
    one coming back.) The recompute of one block's activations is `block_recompute_bytes`.
    pinned=True: the host bytes as the pinned allocator reserves them for the offloader's
    power-of-two pieces (`power_of_two_pieces`): the data, to within 2 MiB per block input.
    keep_attention: each block also keeps its attention output and log-sum-exps
    (`kept_attention_bytes`), where its input is kept.
    """
    if seq_len % sp:
        raise ValueError(f"the sequence length ({seq_len}) must be divisible by the "
                         f"sequence-parallel degree ({sp})")
    per_layer = [seq_len // sp * args.dim * bytes_per_value]
    if keep_attention:
        per_layer += kept_attention_bytes(args, seq_len, sp, bytes_per_value)
    host_buffer = sum(sum(power_of_two_pieces(n)) if pinned else n for n in per_layer)
    on_host = (args.n_layers - 1) * host_buffer if offload else 0
    on_gpu = sum(per_layer) * (1 if offload else args.n_layers)
    return {"gpu": on_gpu, "host": on_host}


def kept_attention_bytes(args, seq_len: int, sp: int, bytes_per_value: int = 2) -> list[int]:
    """keep_attention: the bytes of what one block keeps besides its input, per tensor: the
    attention output (a rank's share of seq x heads x head_dim; the size of the block input
    when heads x head_dim = dim, as in Llama) and its fp32 log-sum-exp, one per head and token
    (1/64 of the output for head_dim 128 in bf16). 05 keeps the latter as one tensor per stage;
    the same bytes."""
    local_tokens = seq_len // sp
    return [local_tokens * args.n_heads * args.head_dim * bytes_per_value,
            local_tokens * args.n_heads * 4]


def power_of_two_pieces(nbytes: int, smallest: int = 2 * MiB) -> list[int]:
    """`nbytes` as a sum of powers of two, largest first (its binary digits), with what is left
    below `smallest` rounded up to a power of two: pieces CUDA's pinned allocator, which rounds
    every request up to a power of two, reserves without waste (3 GiB -> 2 GiB + 1 GiB)."""
    pieces = []
    while nbytes >= smallest:
        pieces.append(1 << (nbytes.bit_length() - 1))
        nbytes -= pieces[-1]
    if nbytes:
        pieces.append(1 << (nbytes - 1).bit_length())
    return pieces


def block_recompute_bytes(args, local_tokens: int, bytes_per_value: int = 2) -> dict:
    """What one block keeps for its backward besides attention (02/05) and the MLP (04), and
    the peak of one RMSNorm's backward: the part of "one block's recompute" that model.py's
    RMSNorm costs. Checkpointing rebuilds this for one block at a time; without it every block
    keeps its "saved" until backward reaches it. Per token:

      saved: each of the two RMSNorms keeps an fp32 copy of its input (4 x dim), the
        normalized copy in the compute dtype and 1/rms (4), and its output is kept by the
        projections (or the MLP) that read it: 2 x (dim x (4 + 2 x bytes) + 4);
      first_norm: the first norm's share of it, kept until the block's input gradient is done;
      norm_backward: an RMSNorm's backward peaks in the gradient of x^2, with its fp32 input
        copy and five fp32 token-sized tensors alive (gradients and pow's temporaries):
        24 x dim bytes, 12 times its bf16 input (counted on CPU; GPU kernels allocate the same).
    (Neither norm keeps its bf16 input: post_norm_input and block_input are 0 here; 04's tiled
    norms do keep theirs.)

    Llama-3-8B, 393,216 tokens per GPU (3M on 8): saved 24 GiB, norm backward 36 GiB.
    """
    dim = args.dim
    one_norm = dim * (4 + 2 * bytes_per_value) + 4
    return {"saved": 2 * one_norm * local_tokens, "first_norm": one_norm * local_tokens,
            "post_norm_input": 0, "block_input": 0, "norm_backward": 24 * dim * local_tokens}


# ---------------------------------------------------------------------------------------------
# The technique: checkpoint every block; optionally hand its saved input to the offloader.
# ---------------------------------------------------------------------------------------------

def apply_checkpointing(model, offload: bool = False, keep_attention: bool = False) -> None:
    """Recompute every block in backward from its saved input; with offload, that input waits
    in host memory between forward and backward (all blocks but the last). keep_attention: each
    block's attention output and log-sum-exp are kept too (beside the input: on the host with
    offload), and the recompute uses them instead of running the attention kernel.

    Runs on the meta-device model before FSDP: only the blocks' forward functions are replaced
    (instance attributes, so parameter names are unchanged) and no parameter is captured.
    The offloader, with its per-step statistics, is `model.checkpoint_offload` (None without
    offload); the kept attention outputs are `model.kept_attention` (None without keep_attention).
    """
    if not hasattr(model, "layers"):
        raise ValueError(f"apply_checkpointing needs a model with .layers (its blocks), "
                         f"got {type(model).__name__}")
    if hasattr(model, "checkpoint_offload"):
        raise ValueError("checkpointing is already applied to this model")
    offloader = BlockInputOffloader(len(model.layers)) if offload else None
    model.checkpoint_offload = offloader
    model.kept_attention = KeptAttention(offloader) if keep_attention else None
    for layer, block in enumerate(model.layers):
        # block.forward is read now: the model's own, or a technique applied before this one.
        contexts = partial(block_contexts, layer, model.kept_attention)
        block.forward = partial(checkpointed_forward, block.forward, layer, offloader, contexts)


def checkpointed_forward(forward, layer: int, offloader, contexts, x: torch.Tensor, rope,
                         cu_seqlens=None) -> torch.Tensor:
    if not torch.is_grad_enabled():  # no backward coming: nothing to save or recompute
        return forward(x, rope, cu_seqlens)
    if offloader is None:
        return checkpoint(forward, x, rope, cu_seqlens, use_reentrant=False, context_fn=contexts)
    # These hooks see what checkpoint saves outside its region: the block's inputs. The rotary
    # cos/sin (a tuple, one for all layers) is held by checkpoint directly and never offloaded,
    # and so are packed documents' boundaries (cu_seqlens, a tuple of ints); `pack` picks the
    # block input out by identity, so any other tensor passes through untouched.
    # The pack hook may only hold a *weak* reference to x: autograd keeps the hooks alive with
    # the graph, and a strong one would pin x in GPU memory however well it was copied away.
    with torch.autograd.graph.saved_tensors_hooks(partial(offloader.pack, layer, weakref.ref(x)),
                                                  offloader.unpack):
        return checkpoint(forward, x, rope, cu_seqlens, use_reentrant=False, context_fn=contexts)


# checkpoint runs the block's forward a second time in backward, only to rebuild what its ops
# save. An op whose output nothing in that rerun reads can skip its work there (04's tiled MLP,
# the last op of a block, does): this flag tells it when it runs inside the recompute.
_recomputing = contextvars.ContextVar("recomputing", default=False)


@contextlib.contextmanager
def _set(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def block_contexts(layer: int, kept: "KeptAttention | None"):
    """checkpoint's context_fn: what runs around the block's forward and around its recompute.
    The recompute is marked; with keep_attention both also tell the attention kernel
    (kernels.kept_attention) which block it runs in."""
    if kept is None:
        return contextlib.nullcontext(), _set(_recomputing, True)
    return _in_block(kept, layer, False), _in_block(kept, layer, True)


@contextlib.contextmanager
def _in_block(kept: "KeptAttention", layer: int, recomputing: bool):
    with _set(_recomputing, recomputing), kernels.keeping_attention(BlockAttention(kept, layer, recomputing)):
        yield


def is_recomputing() -> bool:
    return _recomputing.get()


# ---------------------------------------------------------------------------------------------
# Keeping the attention output: the recompute skips the attention kernel.
# ---------------------------------------------------------------------------------------------

@dataclass
class BlockAttention:
    """What the attention kernel sees of `KeptAttention` inside one checkpointed block."""
    kept: "KeptAttention"
    layer: int
    recomputing: bool

    def keep(self, tensors) -> None:
        self.kept.keep(self.layer, tensors)

    def take(self) -> tuple:
        return self.kept.take(self.layer)


class KeptAttention:
    """Each block's attention output and log-sum-exp(s), from its forward to its recompute.

    kernels.causal_attention (02 and plain attention) keeps (output, lse) in the head layout;
    05 keeps its output buffer and every stage's lse. Without offload they wait on the GPU; with
    it the offloader moves them with the block input: to the host in forward (the last block's
    stay), back one block ahead in backward.
    """

    def __init__(self, offloader: "BlockInputOffloader | None"):
        self.offloader = offloader
        self.on_device = {}  # layer -> tensors, without offload
        self.stats = self.new_stats()  # this step's

    @staticmethod
    def new_stats() -> dict:
        return {"kept": 0, "kept_bytes": 0, "taken": 0}

    def keep(self, layer: int, tensors) -> None:
        if layer == 0:  # a new step: what a step whose backward did not finish left goes now
            self.stats = self.new_stats()
            self.on_device.clear()  # (the offloader forgets its own when block 0 packs its input)
        # New tensor objects over the same memory: autograd gives the returned output a
        # grad_fn, and the recompute returns these again as outputs of its own node.
        tensors = tuple(t.detach() for t in tensors)
        self.stats["kept"] += 1
        self.stats["kept_bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        if self.offloader is not None:
            self.offloader.pack_attention(layer, tensors)
        else:
            self.on_device[layer] = tensors

    def take(self, layer: int) -> tuple:
        self.stats["taken"] += 1
        if self.offloader is not None:
            return self.offloader.take_attention(layer)
        if layer not in self.on_device:
            raise RuntimeError(f"block {layer}'s kept attention output was already used; a "
                               f"second backward through the same graph is not supported")
        return self.on_device.pop(layer)


@dataclass
class SavedBlockInput:
    """What autograd holds instead of a block input between forward and backward (and what the
    offloader holds for each of a block's kept attention tensors)."""
    layer: int
    device: torch.device
    pool: object = None                    # its host buffers' key: the layer, or (layer, i)
    host: "HostBuffer | None" = None       # the copy in host memory while it waits
    on_device: torch.Tensor | None = None  # kept (last block) or brought back, until unpacked
    copied_back: object = None             # CUDA event on the side stream: the copy back is done
    kept: bool = False                     # the last block's: never left the device
    prefetched: bool = False               # its copy back started before its block needed it


class HostBuffer:
    """One block input's place in host memory, in power-of-two pieces (pinned on a GPU machine),
    filled and emptied with one copy per piece."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, pinned: bool):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.nbytes = self.shape.numel() * dtype.itemsize
        self.pieces = [torch.empty(n, dtype=torch.uint8, pin_memory=pinned)
                       for n in power_of_two_pieces(self.nbytes)]

    def holds(self, like: torch.Tensor) -> bool:
        return self.shape == like.shape and self.dtype == like.dtype

    def parts(self, t: torch.Tensor):
        """(piece, the bytes of contiguous t it holds) pairs."""
        flat = t.view(-1).view(torch.uint8)
        start = 0
        for piece in self.pieces:
            n = min(piece.numel(), self.nbytes - start)
            yield piece[:n], flat[start:start + n]
            start += n

    def copy_from(self, t: torch.Tensor, non_blocking: bool = False) -> None:
        for piece, part in self.parts(t):
            piece.copy_(part, non_blocking=non_blocking)

    def copy_into(self, t: torch.Tensor, non_blocking: bool = False) -> None:
        for piece, part in self.parts(t):
            part.copy_(piece, non_blocking=non_blocking)


def is_block_input(t: torch.Tensor, x_ref: weakref.ref) -> bool:
    # Recent torch hands the hook the tensor itself; older versions may hand a new Python
    # object over the same memory.
    x = x_ref()
    return x is not None and (t is x or (t.data_ptr() == x.data_ptr() and t.shape == x.shape
                                         and t.dtype == x.dtype))


class BlockInputOffloader:
    """Moves checkpointed block inputs to host memory in forward and back in backward.

    `stats` counts the current step (it restarts when block 0 saves its input): tensors and
    bytes moved to the host and brought back, how many came back through a prefetch, and the
    order of events ("offload 0", ..., "keep 3", "prefetch 2", "use 3", ...).
    """

    def __init__(self, n_layers: int):
        self.n_layers = n_layers
        self.free_host_buffers = {}  # pool (layer; kept attention: (layer, i)) -> HostBuffers not in use
        self.host_bytes = 0          # all host buffers allocated, in use or free
        self.host_allocations = 0    # how many times a host buffer was allocated
        self.waiting = {}            # layer -> SavedBlockInput on the host, not yet coming back
        self.attention = {}          # layer -> [SavedBlockInput] of its kept attention tensors
        self.stream = None           # the side CUDA stream for every copy, made on first use
        self.stats = self.new_stats()

    @staticmethod
    def new_stats() -> dict:
        return {"offloaded": 0, "offloaded_bytes": 0, "kept": 0, "kept_bytes": 0,
                "restored": 0, "restored_bytes": 0, "prefetched": 0, "events": [],
                "attention_offloaded_bytes": 0, "attention_restored_bytes": 0}

    # --- forward: pack ----------------------------------------------------------------------

    def pack(self, layer: int, x_ref: weakref.ref, t: torch.Tensor):
        if not is_block_input(t, x_ref):
            return t  # older torch also saves an empty placeholder tensor: leave it
        if layer == 0:  # a new step
            self.stats = self.new_stats()
            self.forget_unfinished_step()
        nbytes = t.numel() * t.element_size()
        if layer == self.n_layers - 1:  # backward starts with this one: keep it on the device
            self.log("keep", layer, "kept", nbytes)
            return SavedBlockInput(layer, t.device, on_device=t, kept=True)
        saved = SavedBlockInput(layer, t.device, pool=layer, host=self.take_host_buffer(layer, t))
        self.copy_to_host(t, saved.host)
        self.waiting[layer] = saved
        self.log("offload", layer, "offloaded", nbytes)
        return saved

    def pack_attention(self, layer: int, tensors) -> None:
        """keep_attention: a block's kept attention tensors go the way of its input."""
        if layer == self.n_layers - 1:
            self.attention[layer] = [SavedBlockInput(layer, t.device, on_device=t, kept=True)
                                     for t in tensors]
            self.log("keep attention", layer)
            return
        saved = []
        for i, t in enumerate(tensors):
            saved.append(SavedBlockInput(layer, t.device, pool=(layer, i),
                                         host=self.take_host_buffer((layer, i), t)))
            self.copy_to_host(t, saved[-1].host)
            self.stats["attention_offloaded_bytes"] += t.numel() * t.element_size()
        self.attention[layer] = saved
        self.log("offload attention", layer)

    def forget_unfinished_step(self) -> None:
        """What a step whose backward did not finish left here (block inputs, kept attention):
        its host buffers go back to their pools, what was on the device is let go."""
        for saved in [*self.waiting.values(), *(one for kept in self.attention.values() for one in kept)]:
            if saved.host is not None:
                self.free_host_buffers[saved.pool].append(saved.host)
                saved.host = None
        self.waiting.clear()
        self.attention.clear()

    def take_attention(self, layer: int) -> tuple:
        """The block's kept attention tensors on the device, in its recompute."""
        if layer not in self.attention:
            raise RuntimeError(f"block {layer}'s kept attention output was already used; a "
                               f"second backward through the same graph is not supported")
        saved = self.attention.pop(layer)
        if saved[0].host is not None:  # not prefetched: fetch them now
            self.start_attention_copy_back(saved)
            self.log("fetch attention", layer)
        tensors = []
        for one in saved:
            if one.copied_back is not None:
                torch.cuda.current_stream(one.device).wait_event(one.copied_back)
            tensors.append(one.on_device)
            one.on_device = None
        self.log("use attention", layer)
        return tuple(tensors)

    def start_attention_copy_back(self, saved: list) -> None:
        for one in saved:
            self.stats["attention_restored_bytes"] += one.host.nbytes
            self.start_copy_back(one)

    def take_host_buffer(self, pool, like: torch.Tensor) -> HostBuffer:
        free = self.free_host_buffers.setdefault(pool, [])
        while free:
            buffer = free.pop()
            if buffer.holds(like):
                return buffer
            self.host_bytes -= buffer.nbytes  # new length: let it go
        # Pinned (page-locked) memory: the GPU copies it directly, at full speed and without
        # blocking the host; pageable memory would be staged and ~4x slower. In power-of-two
        # pieces, which the pinned allocator does not round up (see HostBuffer).
        buffer = HostBuffer(like.shape, like.dtype, pinned=like.is_cuda)
        self.host_allocations += 1
        self.host_bytes += buffer.nbytes
        return buffer

    def copy_to_host(self, x: torch.Tensor, host: HostBuffer) -> None:
        x = x.contiguous()  # (block inputs are; a copy would be recorded below like x)
        if not x.is_cuda:
            host.copy_from(x)
            return
        stream = self.side_stream(x.device)
        stream.wait_stream(torch.cuda.current_stream(x.device))  # x must be computed first
        with torch.cuda.stream(stream):
            host.copy_from(x, non_blocking=True)
        # The compute stream runs on. When forward drops x, its memory must not be handed to
        # another tensor before the side stream has read it.
        x.record_stream(stream)

    # --- backward: unpack -------------------------------------------------------------------

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.on_device is None:
            if saved.host is None:
                raise RuntimeError(f"block {saved.layer}'s offloaded input was already used; a "
                                   f"second backward through the same graph is not supported")
            self.waiting.pop(saved.layer, None)
            self.start_copy_back(saved)  # nobody prefetched it: fetch it now
            self.log("fetch", saved.layer)
        if saved.copied_back is not None:  # the compute stream waits for the copy, not the host
            torch.cuda.current_stream(saved.device).wait_event(saved.copied_back)
        # Backward runs the blocks in reverse: start bringing back the previous block's input,
        # so its copy overlaps this block's recompute and backward (and its kept attention).
        previous_attention = self.attention.get(saved.layer - 1)
        if previous_attention and previous_attention[0].host is not None:
            self.start_attention_copy_back(previous_attention)
            self.log("prefetch attention", saved.layer - 1)
        previous = self.waiting.pop(saved.layer - 1, None)
        if previous is not None:
            previous.prefetched = True
            self.start_copy_back(previous)
            self.log("prefetch", previous.layer)
        x, saved.on_device = saved.on_device, None  # now the recompute holds the only reference
        if not saved.kept:
            self.stats["prefetched"] += saved.prefetched
            self.log("use", saved.layer, "restored", x.numel() * x.element_size())
        else:
            self.log("use", saved.layer)
        return x

    def start_copy_back(self, saved: SavedBlockInput) -> None:
        host = saved.host
        if saved.device.type != "cuda":
            saved.on_device = torch.empty(host.shape, dtype=host.dtype)  # new, as on a GPU:
            host.copy_into(saved.on_device)                               # the buffer is reused
        else:
            compute = torch.cuda.current_stream(saved.device)
            # Allocated for the compute stream, which will use and free it. Its memory may have
            # been released by compute work still queued, so the side stream waits for that.
            saved.on_device = torch.empty(host.shape, dtype=host.dtype, device=saved.device)
            stream = self.side_stream(saved.device)
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                host.copy_into(saved.on_device, non_blocking=True)
                saved.copied_back = torch.cuda.Event()
                saved.copied_back.record(stream)
        # Every copy into or out of a host buffer is on the one side stream, in order: the next
        # step's copy out cannot overtake this copy back, so the buffer is free again now.
        self.free_host_buffers[saved.pool].append(host)
        saved.host = None

    def side_stream(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

    def log(self, event: str, layer: int, counter: str | None = None, nbytes: int = 0) -> None:
        self.stats["events"].append(f"{event} {layer}")
        if counter is not None:
            self.stats[counter] += 1
            self.stats[f"{counter}_bytes"] += nbytes


# ---------------------------------------------------------------------------------------------
# Demo: memory vs number of layers, without checkpointing, with it, with offload.
# ---------------------------------------------------------------------------------------------

MODES = {"none": (False, False), "checkpoint": (True, False), "offload": (True, True)}


def measure_mode(ranks, mesh, args, tokens, checkpointing: bool, offload: bool) -> dict:
    """Build the model (Ulysses and FSDP when launched with torchrun), run one forward+backward
    and return {"device": bytes, "host": bytes} for this rank."""
    from support.demos import bytes_saved_for_backward, gradient_bytes

    fsdp = importlib.import_module("01_fsdp")
    ulysses = importlib.import_module("02_ulysses")
    group = dist.group.WORLD if ranks.launched else None

    def techniques(model):
        if ranks.launched:
            ulysses.apply_ulysses(model, group)
        if checkpointing:
            apply_checkpointing(model, offload)

    model = fsdp.build_model(args, ranks.device, mesh, ranks.dtype, exact_init=not ranks.on_gpu,
                             before_sharding=techniques)
    offloader = model.checkpoint_offload if checkpointing else None
    step = partial(ulysses.loss_and_backward, model, tokens.to(ranks.device), ranks.rank,
                   ranks.world, group)
    try:
        if ranks.on_gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            # Above the model state: its gradients grow with the layers, as the parameters do.
            device_bytes = torch.cuda.max_memory_allocated() - before - gradient_bytes(model)
        else:
            device_bytes = bytes_saved_for_backward(step, offloader)
    except torch.OutOfMemoryError:
        device_bytes = None
    host_bytes = offloader.host_bytes if offloader else 0
    del model, offloader, step
    gc.collect()  # a block and its replaced forward refer to each other: free them now
    if ranks.on_gpu:
        torch.cuda.empty_cache()
    return {"device": device_bytes, "host": host_bytes}


def main():
    from support.data import parse_tokens
    from support.demos import end_ranks, start_ranks
    from model import get_model_args

    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b" if on_gpu else "small")
    parser.add_argument("--seq-len", default="32K" if on_gpu else "4K", help="total tokens")
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    opts = parser.parse_args()
    seq_len = parse_tokens(opts.seq_len)
    base_args = get_model_args(opts.model)
    ranks = start_ranks()
    mesh = None
    if ranks.launched:  # FSDP over every rank, Ulysses over every rank
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(ranks.device.type, (ranks.world,))
        importlib.import_module("02_ulysses").check_ulysses_shapes(
            base_args.n_heads, base_args.n_kv_heads, ranks.world, seq_len)
    tokens = torch.randint(0, base_args.vocab_size, (1, seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    itemsize = ranks.dtype.itemsize
    sp = ranks.world

    rows = []
    for n_layers in opts.layers:
        args = replace(base_args, n_layers=n_layers)
        measured = {mode: measure_mode(ranks, mesh, args, tokens, *flags)
                    for mode, flags in MODES.items()}
        planned = {offload: checkpoint_memory_bytes(args, seq_len, sp, offload, itemsize)
                   for offload in (False, True)}
        rows.append((n_layers, measured, planned))

    if ranks.rank == 0:
        unit, unit_name = (GiB, "GiB") if on_gpu else (MiB, "MiB")
        how = ("peak GPU memory allocated in forward+backward above the parameters and their "
               "gradients" if on_gpu
               else "bytes kept from forward to backward (saved tensors; CPU)")
        print(f"{opts.model} cut to {'/'.join(map(str, opts.layers))} layers, {seq_len:,} "
              f"tokens over {ranks.world} rank(s) "
              f"(sp {sp}: {seq_len // sp:,} local), {ranks.dtype} on {ranks.device.type}"
              f"{', FSDP + Ulysses' if ranks.launched else ''}")
        print(f"per rank, {unit_name}: {how}; host = the offloader's host buffers (pinned on a "
              f"GPU machine); planner = checkpoint_memory_bytes (block inputs only)")
        print(f"{'layers':>6}{'none':>10}{'checkpoint':>12}{'offload':>10}{'host':>10}"
              f"{'planner: ckpt gpu':>19}{'offload gpu':>13}{'host':>8}")
        show = lambda n: "OOM" if n is None else f"{n / unit:.1f}"  # noqa: E731
        for n_layers, measured, planned in rows:
            print(f"{n_layers:>6}{show(measured['none']['device']):>10}"
                  f"{show(measured['checkpoint']['device']):>12}"
                  f"{show(measured['offload']['device']):>10}"
                  f"{show(measured['offload']['host']):>10}{show(planned[False]['gpu']):>19}"
                  f"{show(planned[True]['gpu']):>13}{show(planned[True]['host']):>8}")
    end_ranks()


if __name__ == "__main__":
    main()
