"""03 - Activation checkpointing, then offloading the checkpoints to CPU memory.

The memory problem. After FSDP (01) and Ulysses (02), Llama-3-8B at 3M tokens on 8 GPUs gives
each GPU 393,216 tokens, and backward still needs what every layer saved in forward: about
136 KiB per token per layer in bf16 (the norms' inputs and outputs, q/k/v and the attention
output, three x 14,336 MLP intermediates per token: gate, up and their product; model.py's
op-by-op MLP keeps silu(gate) as a fourth, base/fused.py's SwiGLU only two), so
393,216 x 136 KiB x 32 layers = 1,632 GiB per GPU.

The idea, in two steps.
  1. Checkpointing: keep only each block's input, and run the block's forward again in backward,
     just before its own backward, to rebuild what it saved. One block's activations exist at a
     time; what stays is 32 block inputs of 393,216 x 4,096 x 2 bytes = 3 GiB each: 96 GiB per
     GPU, still more than an 80 GiB H100 holds next to 15 GiB of model state.
  2. Offloading the checkpoints: copy each block input to host memory as soon as the block has
     it, and bring it back just before that block's backward. Between forward and backward the
     GPU keeps only the last block's input (backward starts there): 3 GiB; during backward two,
     the one the current block recomputes from and the next one coming back: 6 GiB, for 4 layers
     or 80. The host holds 31 per GPU: 93 GiB, in pinned buffers reused every step
     (base/host_buffers.py: power-of-two pieces, which the pinned allocator does not round up).
Where memory allows, only the first k blocks need it (`checkpointed=k`, train.py's
--checkpoint-layers): the other L - k keep their activations and skip the recompute, one forward
pass each (plan.py finds the smallest k that fits). Even those need not keep everything: each of a
block's two RMSNorm outputs (8 KiB per token) is kept only by the layers that read it, and the
norm's input, which the norm keeps anyway, gives it back in one pass over memory. So a kept block
releases them once read and computes them again when backward reaches their readers: 16 of the 136
KiB per token above (Megatron's selective recompute of the norms); at 16K tokens on Llama-3-8B 256
MiB per block.

The copies run on a side CUDA stream, beside the compute. In forward it copies each block input
out while the compute stream runs the next block; in backward, when block i's input is unpacked,
block i-1's starts coming back during block i's recompute and backward. The copies are the small
part: per token a block input is 8 KiB (4,096 bf16 values), while the block's recompute and
backward do about 1.3 GFLOP (three passes over its 218M parameters), plus attention's share, which
grows with the length.

The engine is PyTorch's: `checkpoint(..., use_reentrant=False)` saves the block's inputs through
the saved-tensors mechanism, outside the region it recomputes, so `saved_tensors_hooks(pack,
unpack)` around the call sees exactly them: `pack` moves the hidden state to the host and returns
a handle, `unpack` returns it on the GPU. FSDP2 (one `fully_shard` per block) gathers the block's
parameters around its forward and its recompute. Ops inside a block can ask which block runs and
whether it is the recompute (base/checkpointed.py).

    python 03_checkpoint_offload.py                       # CPU: small model, bytes kept
    torchrun --nproc-per-node 2 03_checkpoint_offload.py  # FSDP + Ulysses: CPU/gloo, or GPUs
                                                          # (llama3-8b, 32K tokens)
"""

import weakref
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from base import checkpointed
from base.host_buffers import HostBuffer, HostBufferPool

GiB, MiB = 2**30, 2**20


# Checkpointing: each block keeps its input and runs again in backward.

def checkpointed_forward(forward, layer: int, offloader, x: torch.Tensor, rope,
                         cu_seqlens=None) -> torch.Tensor:
    """A block's forward under `checkpoint`: only x (and the rotary tables) are saved for
    backward, the rest is rebuilt by running `forward` again; with an offloader, x waits on
    the host in between."""
    if not torch.is_grad_enabled():  # no backward coming: nothing to save or recompute
        return forward(x, rope, cu_seqlens)
    contexts = partial(block_contexts, layer, offloader)
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


def block_contexts(layer: int, offloader):
    """checkpoint's context_fn: (around the block's forward, around its recompute), each saying
    which block runs and which of its two runs this is (base/checkpointed.py)."""
    return (checkpointed.running(layer, False, offloader),
            checkpointed.running(layer, True, offloader))


# Offloading: pack (copy to the host), unpack (and prefetch the previous block's back).

@dataclass
class HeldTensor:
    """What the offloader holds for a block input; autograd holds this handle instead of it."""
    layer: int
    nbytes: int
    device: torch.device
    key: object = None                     # its host buffer's key in the pool (03: the layer)
    host: HostBuffer | None = None         # the copy in host memory while it waits
    on_device: torch.Tensor | None = None  # kept (last block) or brought back, until used
    copied_back: object = None             # CUDA event on the side stream: the copy back is done
    kept: bool = False                     # the last checkpointed block's: stayed
    prefetched: bool = False               # its copy back started before its block needed it


class BlockInputOffloader:
    """Moves checkpointed block inputs to host memory in forward and back in backward, one block
    ahead of their use."""

    def __init__(self, n_checkpointed: int):
        self.n_checkpointed = n_checkpointed  # blocks 0 .. n_checkpointed - 1 (the last stays)
        self.host_buffers = HostBufferPool()  # pinned host memory by layer, reused every step
        self.waiting = {}       # layer -> its input's HeldTensor, on the host
        self.stream = None      # the side CUDA stream for every copy, made on first use
        self.stats = new_step_record()  # this step's: what moved, in which order (below)

    # --- forward: pack ------------------------------------------------------------------------

    def pack(self, layer: int, x_ref: weakref.ref, t: torch.Tensor):
        if not is_block_input(t, x_ref):
            return t  # anything else checkpoint saves (an empty placeholder, in some versions)
        if layer == 0:
            self.new_step()
        held = self.hold(layer, t, key=layer)
        if not held.kept:
            self.waiting[layer] = held
        record(self.stats, "keep" if held.kept else "offload", held)
        return held

    def new_step(self) -> None:
        """Block 0 saves its input: a step whose backward never ran gives its buffers back."""
        self.stats = new_step_record()
        for held in self.waiting.values():
            self.let_go(held)
        self.waiting.clear()

    def hold(self, layer: int, t: torch.Tensor, key) -> HeldTensor:
        """t, kept by block `layer` for its backward: on the device for the last checkpointed
        block (backward reaches it first, so copying out would only make backward wait), else
        copied to a host buffer of the pool's `key` (the layer here; support/keep_attention.py's
        offloader, a subclass, holds an attention output and its log-sum-exp per layer too)."""
        held = HeldTensor(layer, t.numel() * t.element_size(), t.device)
        if layer == self.n_checkpointed - 1:
            held.on_device, held.kept = t, True
            return held
        held.key = key
        held.host = self.host_buffers.take(key, t)
        t = t.contiguous()  # (block inputs are; a copy would be recorded below like t)
        if not t.is_cuda:
            held.host.copy_from(t)
            return held
        stream = self.side_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))  # t must be computed first
        with torch.cuda.stream(stream):
            held.host.copy_from(t, non_blocking=True)
        # The compute stream runs on. When forward drops t, its memory must not be handed to
        # another tensor before the side stream has read it.
        t.record_stream(stream)
        return held

    # --- backward: unpack, prefetch ---------------------------------------------------------

    def unpack(self, held):
        if isinstance(held, torch.Tensor):
            return held
        if held.on_device is None:
            if held.host is None:
                raise RuntimeError(f"block {held.layer}'s offloaded input was already used; a "
                                   f"second backward through the same graph is not supported")
            self.bring_back(held.layer, "fetch")  # nobody prefetched it: fetch it now
        x = self.hand_over(held)  # now the recompute holds the only reference
        # Backward runs the blocks in reverse: start bringing back the previous block's input,
        # so the copy overlaps this block's recompute and backward.
        self.bring_back(held.layer - 1, "prefetch")
        record(self.stats, "use", held)
        return x

    def bring_back(self, layer: int, event: str) -> None:
        """Start the copy back of block `layer`'s input, if it waits on the host."""
        held = self.waiting.pop(layer, None)
        if held is not None:
            held.prefetched = event == "prefetch"
            self.copy_back(held)
            record(self.stats, event, held)

    def copy_back(self, held: HeldTensor) -> None:
        """Start the copy from the host into a new device tensor, `held.on_device`."""
        host = held.host
        if held.device.type != "cuda":
            held.on_device = torch.empty(host.shape, dtype=host.dtype)  # new, as on a GPU:
            host.copy_into(held.on_device)                               # the buffer is reused
        else:
            compute = torch.cuda.current_stream(held.device)
            # Allocated for the compute stream, which will use and free it. Its memory may have
            # been released by compute work still queued, so the side stream waits for that.
            held.on_device = torch.empty(host.shape, dtype=host.dtype, device=held.device)
            stream = self.side_stream(held.device)
            stream.wait_stream(compute)
            with torch.cuda.stream(stream):
                host.copy_into(held.on_device, non_blocking=True)
                held.copied_back = torch.cuda.Event()
                held.copied_back.record(stream)
        # Every copy into or out of a host buffer is on the one side stream, in order: the next
        # step's copy out cannot overtake this copy back, so the buffer is free again now.
        self.host_buffers.give_back(held.key, host)
        held.host = None

    def hand_over(self, held: HeldTensor) -> torch.Tensor:
        """The tensor on the device; the compute stream, not the host, waits for its copy back."""
        if held.copied_back is not None:
            torch.cuda.current_stream(held.device).wait_event(held.copied_back)
        t, held.on_device = held.on_device, None
        return t

    def let_go(self, held: HeldTensor) -> None:
        """A held tensor whose backward never ran: its host buffer goes back to the pool."""
        if held.host is not None:
            self.host_buffers.give_back(held.key, held.host)
            held.host = None

    def side_stream(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream


def is_block_input(t: torch.Tensor, x_ref: weakref.ref) -> bool:
    # The hook may be handed x itself or another Python object over the same memory.
    x = x_ref()
    return x is not None and (t is x or (t.data_ptr() == x.data_ptr() and t.shape == x.shape
                                         and t.dtype == x.dtype))


def apply_checkpointing(model, offload: bool = False, checkpointed: int | None = None,
                        offloader_class=BlockInputOffloader) -> None:
    """Recompute the first `checkpointed` blocks (None: all) in backward from their saved inputs;
    with offload, those inputs wait in host memory between forward and backward (all but the
    last checkpointed block's). The other blocks keep their activations, as plain training does,
    but for their norms' outputs (`recompute_norms`).

    Runs on the meta-device model before FSDP: only the blocks' forward functions are replaced
    (instance attributes, so parameter names are unchanged) and no parameter is captured. The
    offloader is `model.checkpoint_offload` (None without offload), an `offloader_class` (a
    subclass may move more with each block input).
    """
    checkpointed = check_model(model, checkpointed)
    # The first blocks (Megatron's "block" method). For memory any choice of k blocks is the
    # same at the end of forward, where every block holds its checkpoint or its activations;
    # the first are the best in backward, which reaches the blocks that kept everything first
    # and frees them before any recompute starts. The last checkpointed block is the offloader's
    # "last": backward reaches its input first among the checkpoints, so it stays on the GPU.
    offloader = offloader_class(checkpointed) if offload else None
    model.checkpoint_offload = offloader
    for layer, block in enumerate(model.layers[:checkpointed]):
        # block.forward is read now: the model's own, or what a technique applied before this
        # one made of it (it runs inside the checkpoint: in the forward and in the recompute).
        block.forward = partial(checkpointed_forward, block.forward, layer, offloader)
    for block in model.layers[checkpointed:]:
        recompute_norms(block)


# The blocks that keep their activations: their norms' outputs are computed again instead.

def recompute_norms(block) -> None:
    """Each RMSNorm output of `block` is released once its reader (the attention, the MLP) has
    run, and computed again, into the same storage, when backward reaches that reader. (Code
    that reads it in between, a hook of your own, finds no memory behind it.)"""
    block.norm_recompute_hooks = []  # (07 removes them where a block's outputs go to the host)
    for norm, reader in ((block.input_layernorm, block.self_attn),
                         (block.post_attention_layernorm, block.mlp)):
        latest = {}  # the norm's input and output, from its forward until its reader's
        block.norm_recompute_hooks += [
            norm.register_forward_hook(partial(remember_norm, latest)),
            reader.register_forward_hook(partial(release_norm_output, norm, latest))]


def remember_norm(latest: dict, norm, inputs, output) -> None:
    if output.requires_grad:  # a backward will come (not under torch.no_grad)
        latest["input"], latest["output"] = inputs[0], output


def release_norm_output(norm, latest: dict, reader, inputs, output) -> None:
    """After the reader's forward: free the norm output it read (every view the reader saved
    shares that memory), and hook the reader's output, whose gradient backward computes just
    before the reader's own backward, to compute it again."""
    x, y = latest.pop("input", None), latest.pop("output", None)
    if y is None or inputs[0] is not y or not output.requires_grad:
        return
    nbytes = y.untyped_storage().nbytes()
    y.untyped_storage().resize_(0)
    # The hook lives as long as the step's graph: it lets go of x and y once it has run, so
    # that y goes when its reader's backward is done with it.
    held = [x, y]

    def compute_again(grad_output):
        if not held:  # a second backward through the same graph: y is there already
            return
        x, y = held
        held.clear()
        y.untyped_storage().resize_(nbytes)
        # the same kernel on the same input: bit for bit what forward computed; writing it
        # back is no in-place change autograd must refuse, so y's version stays
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(y):
            y.copy_(norm(x))

    output.register_hook(compute_again)


# ---- below: checks, the step record, demo --------------------------------------------------------

def check_model(model, checkpointed: int | None) -> int:
    """How many blocks to checkpoint (`checkpointed`, None: all), refused unless 1..n_layers."""
    if not hasattr(model, "layers"):
        raise ValueError(f"apply_checkpointing needs a model with .layers (its blocks), "
                         f"got {type(model).__name__}")
    if hasattr(model, "checkpoint_offload"):
        raise ValueError("checkpointing is already applied to this model")
    n_layers = len(model.layers)
    if checkpointed is not None and not 1 <= checkpointed <= n_layers:
        raise ValueError(f"the blocks to checkpoint must be 1 to the model's {n_layers} layers, "
                         f"got {checkpointed}")
    return n_layers if checkpointed is None else checkpointed


# The offloader's record of one step (restarted when block 0 saves its input), which the tests
# read: block inputs and their bytes offloaded, kept on the device and restored, how many came
# back through a prefetch, and the events in order ("offload 0", ..., "keep 3", "prefetch 2",
# "use 3", ...). The CPU demo's measurement adds its kept bytes (support/demos.py).

def new_step_record() -> dict:
    return {"offloaded": 0, "offloaded_bytes": 0, "kept": 0, "kept_bytes": 0,
            "restored": 0, "restored_bytes": 0, "prefetched": 0, "events": []}


def record(stats: dict, event: str, held) -> None:
    """Append "event layer"; an offload, a keep and a use from the host also count, with their
    bytes."""
    stats["events"].append(f"{event} {held.layer}")
    counted = {"offload": "offloaded", "keep": "kept", "use": "restored"}.get(event)
    if counted and not (event == "use" and held.kept):
        stats[counted] += 1
        stats[f"{counted}_bytes"] += held.nbytes
        stats["prefetched"] += event == "use" and held.prefetched


# Demo: the bytes kept for backward against the number of layers, without checkpointing, with it,
# with offload; beside them what support/byte_counts.py plans for the block inputs.

MODES = {"none": (False, False), "checkpoint": (True, False), "offload": (True, True)}


def apply_mode(mode: str, model) -> None:
    checkpoints, offload = MODES[mode]
    if checkpoints:
        apply_checkpointing(model, offload)


def main():
    from support.byte_counts import checkpoint_memory_bytes
    from support.demos import (demo_parser, demo_setup, end_ranks, in_units, measure_step_memory,
                               print_table, step_memory_meaning)

    parser = demo_parser(__doc__, cpu=("small", "2K"), gpu=("llama3-8b", "32K"))
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    demo = demo_setup(parser.parse_args())
    # Launched with torchrun: FSDP and Ulysses over every rank.
    mesh = init_device_mesh(demo.device.type, (demo.world,)) if demo.launched else None
    unit, unit_name = (GiB, "GiB") if demo.on_gpu else (MiB, "MiB")
    rows = []
    for n_layers in demo.opts.layers:
        args = replace(demo.args, n_layers=n_layers)
        kept = {mode: measure_step_memory(demo, args, mesh, partial(apply_mode, mode))
                for mode in MODES}
        plan = [checkpoint_memory_bytes(args, demo.seq_len, demo.world, offload,
                                        demo.dtype.itemsize) for offload in (False, True)]
        numbers = [*(kept[mode]["device"] for mode in MODES), kept["offload"]["host"],
                   plan[0]["gpu"], plan[1]["gpu"], plan[1]["host"]]
        rows.append([n_layers, *(in_units(n, unit) for n in numbers)])
    if demo.rank == 0:
        layers = "/".join(map(str, demo.opts.layers))
        print(f"{demo.setting}, cut to {layers} layers{', FSDP + Ulysses' if mesh else ''}")
        print(f"per rank, {unit_name}: {step_memory_meaning(demo.on_gpu)}; host: the offloader's "
              f"host buffers; planner: support/byte_counts.py's block inputs")
        print_table(["layers", "none", "checkpoint", "offload", "host", "planner: ckpt gpu",
                     "offload gpu", "host"], rows, [6, 10, 12, 10, 10, 19, 13, 8])
        print("measured - planner: what the model keeps for backward outside its blocks (the "
              "final norm, the loss's tokens x vocab log-probabilities, which 04's tiled loss "
              "removes)" + ("; on a GPU also one block's recompute and backward" if demo.on_gpu
                            else ""))
    end_ranks()


if __name__ == "__main__":
    main()
