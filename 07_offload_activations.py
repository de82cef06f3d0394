"""07 - Offloading a block's activations to host memory, instead of recomputing them.

The memory problem. Llama-3-8B on one H200 (139.8 GiB): the model state, fp32 weights and
Adam's two moments, takes 89.7 GiB before any activation. A block keeps about 92 KiB per token
for its backward: 03's 136, less one 14,336-wide MLP intermediate (28: base/fused.py's MLP keeps
gate and up only) and the norms' outputs (16: 03's recompute_norms gives them back). That is 1.4
GiB at 16K tokens, 2.9 GiB at 32K, so 32 blocks want 46 GiB and 92 GiB. 03 makes them fit by
checkpointing the first k blocks, and each of those runs its forward twice.

The idea. The GPU has copy engines that run beside its compute. A block can keep everything it
saved, not on the GPU but in pinned host memory: each saved tensor is copied out on a side
stream while the next blocks compute, and in backward a block's tensors come back during the
backward of the block above it. Nothing is computed twice. The copies cost time only where they
cannot hide: at 55 GB/s each way (pinned copies on an H200 machine), a 16K block's 1.7 GiB (108
KiB a token: its norms' outputs go too) takes ~33 ms each way, about two blocks' forward and one
block's backward. So the offloaded blocks alternate with kept ones: a block's copy out has the
end of its own forward and the next two blocks' (the top block: the one above it) before its
memory is needed again, and its copy back runs during the backward of the kept block above it.
Half of the L - K blocks above 03's can go this way (plan.py finds how many fit).

    --offload-activations N   blocks K, K + 2, ..., K + 2(N - 1), K = 03's checkpointed blocks

The engine is PyTorch's saved-tensors hooks again: around an offloaded block's forward, `pack`
receives every tensor autograd saves for backward and returns a handle; `unpack` returns the
tensor on the GPU. Three details make it exact and cheap:
  - the unit is the bytes a saved tensor spans, copied once: a tensor saved by two ops moves
    once, and a view only the span of its part of a larger buffer (the chunks of one fused
    projection, were a model to split one, each its own; views that overlap are copied twice);
  - the block's parameters stay (FSDP2 frees its gathered copies after forward and gathers
    them again for backward), and so do the block's other arguments (the rotary tables, shared
    by every block);
  - the host buffers are reused every step (base/host_buffers.py, as 03's).
A saved tensor changed in place after it was saved, which autograd refuses, is not checked
under these hooks: its copy out would race the change.

    python 07_offload_activations.py                       # CPU: small model, bytes kept
    torchrun --nproc-per-node 2 07_offload_activations.py  # FSDP: CPU/gloo, or GPUs
"""

from dataclasses import dataclass, replace
from functools import partial

import torch

from base.host_buffers import HostBuffer, HostBufferPool

GiB, MiB = 2**30, 2**20


# Forward: an offloaded block's saved tensors go to the host; the kept block above it brings
# them back in backward.

def offloaded_forward(forward, layer: int, offloader, x: torch.Tensor, rope, cu_seqlens=None):
    """A block's forward whose saved tensors wait in host memory until its backward."""
    if not torch.is_grad_enabled():  # no backward coming: nothing is saved
        return forward(x, rope, cu_seqlens)
    # The rotary tables and documents' boundaries are every block's: they stay where they are.
    offloader.begin_block(layer, stays=[t for t in (*rope, cu_seqlens) if torch.is_tensor(t)])
    try:
        with torch.autograd.graph.saved_tensors_hooks(partial(offloader.pack, layer),
                                                      offloader.unpack):
            out = forward(x, rope, cu_seqlens)
    finally:
        offloader.end_block(layer)
    # The offloaded block two below has had this block's and the one between's forward to
    # finish its copy out: its memory can go now.
    offloader.release(layer - 2)
    return out


def kept_above_forward(forward, layer: int, offloader, top: bool, x: torch.Tensor, rope,
                       cu_seqlens=None):
    """The forward of a kept block right above an offloaded one (layer - 1): its backward
    brings that block's tensors back; above the top offloaded block, its forward lets that
    block's memory go."""
    out = forward(x, rope, cu_seqlens)
    if top:
        offloader.release(layer - 1)
    if not out.requires_grad:
        return out
    # The gradient of a block's output is computed just before the block's own backward: then
    # the offloaded block below starts coming back, and its copy overlaps this block's backward.
    out.register_hook(lambda grad: offloader.bring_back(layer - 1, "prefetch"))
    return out


# The offloader: one handle per saved tensor, one host copy per distinct saved tensor.

@dataclass
class SavedBytes:
    """The bytes a saved tensor spans in its storage: on the host between forward and
    backward."""
    layer: int
    nbytes: int
    device: torch.device
    forward_count: int                     # the offloader's forward that saved it
    key: object = None                     # its host buffer's key in the pool: (layer, index)
    host: HostBuffer | None = None         # its bytes in host memory while they wait
    on_device: torch.Tensor | None = None  # its bytes (uint8) back on the device
    prefetched: bool = False               # its copy back started before its block needed it
    used: bool = False                     # backward has read it


@dataclass
class SavedView:
    """What autograd holds instead of a saved tensor: how to view its SavedBytes again."""
    saved: SavedBytes
    size: torch.Size
    stride: tuple
    dtype: torch.dtype


class ActivationOffloader:
    """Moves what the offloaded blocks save to host memory in forward and back in backward, one
    block ahead of their use.

    Memory and streams: a saved tensor's memory is read by the copy out on the side stream, so
    it may be reused only after that copy. The offloader keeps the tensors of a block until the
    next offloaded block's forward has run (the top one's: the kept block's above it), then
    makes the compute stream wait for the block's copies (one CUDA event) and lets them go:
    whatever the compute stream allocates there afterwards runs after the copy. (record_stream
    would leave that to the allocator, which reuses such memory only once the copy has finished
    by the time the host asks, and the host runs blocks ahead of the GPU: the memory of every
    block in flight would stay reserved.) The copies back are written into memory the compute
    stream allocates, and it waits for them (one event per block) before it reads any."""

    def __init__(self, layers: range):
        self.layers = layers  # the offloaded blocks (every other one: a kept block above each)
        self.host_buffers = HostBufferPool()  # pinned host memory by (layer, index), reused
        self.waiting = {}    # layer -> its SavedBytes on the host
        self.packing = {}    # the running block's: (address, bytes) -> SavedBytes, its source
        self.stays = set()   # the running block's: addresses of storages that stay
        self.leaving = {}    # layer -> (its copies out done: event, its sources) until released
        self.arrived = {}    # layer -> (its copies back done: event, their memory) until read
        self.forward_count = 0  # forwards through the lowest offloaded block so far
        self.stream = None   # the side CUDA stream for every copy, made on first use
        self.stats = new_step_record()

    # --- forward: pack, send, release ---------------------------------------------------------

    def pack(self, layer: int, t: torch.Tensor):
        base = t if t._base is None else t._base
        storage = t.untyped_storage()
        if ((base.is_leaf and base.requires_grad)  # a parameter (or a view of one, W^T)
                or storage.data_ptr() in self.stays or storage.nbytes() == 0):
            return t
        start = t.storage_offset() * t.element_size()
        spans = (1 + sum((n - 1) * step for n, step in zip(t.size(), t.stride()))
                 if t.numel() else 0) * t.element_size()
        which = (storage.data_ptr() + start, spans)  # views over the same bytes: one copy
        if which not in self.packing:  # bytes saved for the first time: copy them out
            source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                storage, start, (spans,), (1,))
            # (held until released: no later tensor gets this memory before the copy read it)
            self.packing[which] = (self.send(layer, source), source)
        return SavedView(self.packing[which][0], t.size(), t.stride(), t.dtype)

    def send(self, layer: int, source: torch.Tensor) -> SavedBytes:
        """Start the copy of `source` (uint8) to a host buffer."""
        key = (layer, len(self.packing))  # the same key for the same tensor every step
        device = source.device
        saved = SavedBytes(layer, source.numel(), device, self.forward_count, key)
        saved.host = self.host_buffers.take(key, source)
        self.waiting.setdefault(layer, []).append(saved)
        record(self.stats, "offload", saved)
        if device.type != "cuda":
            saved.host.copy_from(source)
            return saved
        stream = self.side_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # the tensor is computed first
        with torch.cuda.stream(stream):
            saved.host.copy_from(source, non_blocking=True)
        return saved

    def begin_block(self, layer: int, stays: list) -> None:
        if layer == self.layers.start:
            self.new_step()
        self.packing = {}
        self.stays = {t.untyped_storage().data_ptr() for t in stays}

    def end_block(self, layer: int) -> None:
        sources = [source for _, source in self.packing.values()]
        self.leaving[layer] = (self.side_event(sources[0].device) if sources else None, sources)
        self.packing, self.stays = {}, set()  # the handles own the SavedBytes from now on

    def release(self, layer: int) -> None:
        """Block `layer`'s saved tensors may go: the compute stream waits for their copies."""
        if layer not in self.leaving:
            return
        done, _ = self.leaving.pop(layer)  # (the sources go on return)
        if done is not None:  # the compute stream reuses their memory after the copies
            torch.cuda.current_stream(self.stream.device).wait_event(done)
        record(self.stats, "release", None, layer)

    def new_step(self) -> None:
        """The lowest offloaded block runs: a step whose backward never ran gives its buffers
        back."""
        self.stats = new_step_record()
        self.forward_count += 1
        for layer in list(self.leaving):
            self.release(layer)
        for layer in list(self.arrived):  # brought back, never read (autograd.grad of a part)
            self.wait_for_copies_back(layer)
        for block_saved in self.waiting.values():
            for saved in block_saved:
                self.host_buffers.give_back(saved.key, saved.host)
                saved.host = None
        self.waiting.clear()

    # --- backward: bring back, unpack ---------------------------------------------------------

    def bring_back(self, layer: int, why: str) -> None:
        """Start the copy back of what block `layer` saved, if it waits on the host."""
        block_saved = self.waiting.pop(layer, [])
        if not block_saved:
            return
        device = block_saved[0].device
        if device.type == "cuda":
            # The memory is the compute stream's, and may have been released by compute work
            # still queued: the side stream waits for that, then copies.
            stream = self.side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
        for saved in block_saved:
            saved.prefetched = why == "prefetch"
            saved.on_device = torch.empty(saved.nbytes, dtype=torch.uint8, device=device)
            if device.type != "cuda":
                saved.host.copy_into(saved.on_device)
            else:
                with torch.cuda.stream(stream):
                    saved.host.copy_into(saved.on_device, non_blocking=True)
            # Every copy to or from a host buffer is on the one side stream, in order: the next
            # step's copy out cannot overtake this copy back, so the buffer is free again now.
            self.host_buffers.give_back(saved.key, saved.host)
            saved.host = None
        # (their memory is held here too until the compute stream waits for the copies: a
        # block never read, by autograd.grad of a part of the model, goes at the next step)
        self.arrived[layer] = (self.side_event(device), [saved.on_device for saved in block_saved])
        record(self.stats, why, None, layer)

    def wait_for_copies_back(self, layer: int) -> None:
        done, _ = self.arrived.pop(layer, (None, None))
        if done is not None:  # the compute stream waits; then the memory is its own
            torch.cuda.current_stream(self.stream.device).wait_event(done)

    def unpack(self, view):
        if isinstance(view, torch.Tensor):
            return view
        saved = view.saved
        if saved.forward_count != self.forward_count:
            raise RuntimeError("07 holds one forward's tensors at a time: another forward ran "
                               "through the offloaded blocks before this backward")
        if saved.on_device is None:  # nobody prefetched it: now, and wait
            self.bring_back(saved.layer, "fetch")
        self.wait_for_copies_back(saved.layer)  # (its block's first tensor read)
        if not saved.used:
            saved.used = True
            record(self.stats, "use", saved)
        return torch.empty(0, dtype=view.dtype, device=saved.device).set_(
            saved.on_device.untyped_storage(), 0, view.size, view.stride)

    def side_stream(self, device: torch.device):
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

    def side_event(self, device: torch.device):
        """An event after the side stream's copies so far (None on the CPU: copies are done)."""
        if device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(self.side_stream(device))
        return event


def apply_activation_offload(model, count: int, first: int = 0) -> None:
    """Offload what `count` blocks save for backward: every other block from `first` on (03
    checkpoints the blocks below `first`), each with a kept block above it, whose backward
    brings it back and whose forward gives its copy out time. The offloader is
    `model.activation_offload`.

    Runs on the meta-device model before FSDP, after 03: only the blocks' forward functions are
    replaced (instance attributes: parameter names are unchanged), and the offloaded blocks'
    norms' outputs go to the host with the rest instead of being computed again (03's
    recompute_norms)."""
    layers = check_model(model, count, first)
    offloader = ActivationOffloader(layers)
    model.activation_offload = offloader
    for layer in layers:
        block = model.layers[layer]
        for hook in block.__dict__.pop("norm_recompute_hooks", []):
            hook.remove()
        block.forward = partial(offloaded_forward, block.forward, layer, offloader)
        above = model.layers[layer + 1]
        above.forward = partial(kept_above_forward, above.forward, layer + 1, offloader,
                                layer == layers[-1])


# ---- below: checks, the step record, demo --------------------------------------------------------

def check_model(model, count: int, first: int) -> range:
    """The offloaded blocks (every other one from `first`), refused unless 1 <= count and each
    has a block of the model above it."""
    if not hasattr(model, "layers"):
        raise ValueError(f"apply_activation_offload needs a model with .layers (its blocks), "
                         f"got {type(model).__name__}")
    if hasattr(model, "activation_offload"):
        raise ValueError("activation offload is already applied to this model")
    n_layers = len(model.layers)
    if count < 1 or first < 0:
        raise ValueError(f"activation offload needs at least 1 block from a block >= 0, got "
                         f"{count} from block {first}")
    if first + 2 * count > n_layers:
        raise ValueError(f"{count} offloaded blocks from block {first}, each with a kept block "
                         f"above it, need {2 * count} layers from block {first}; the model "
                         f"has {n_layers - first} there ({n_layers} layers, 03's checkpointed "
                         f"ones below block {first})")
    return range(first, first + 2 * count, 2)


# The offloader's record of one step (restarted when the lowest offloaded block runs), which the
# tests read: the saved tensors and their bytes sent to the host and used again in backward, how
# many came back through a prefetch, and the events in order ("offload 3", ..., "prefetch 2",
# "use 3", ...: one "offload" and one "use" per distinct saved tensor).

def new_step_record() -> dict:
    return {"offloaded": 0, "offloaded_bytes": 0, "restored": 0, "restored_bytes": 0,
            "prefetched": 0, "events": []}


def record(stats: dict, event: str, saved: SavedBytes | None, layer: int | None = None):
    stats["events"].append(f"{event} {saved.layer if saved else layer}")
    counted = {"offload": "offloaded", "use": "restored"}.get(event)
    if counted:
        stats[counted] += 1
        stats[f"{counted}_bytes"] += saved.nbytes
        stats["prefetched"] += event == "use" and saved.prefetched


# Demo: the bytes kept for backward on the device, and in host memory, against the offloaded
# blocks; beside them what the planner counts for one block (support/byte_counts.py).

def main():
    from support.demos import (demo_parser, demo_setup, end_ranks, in_units, measure_step_memory,
                               print_table, step_memory_meaning)

    parser = demo_parser(__doc__, cpu=("small", "2K"), gpu=("llama3-8b", "16K"))
    parser.add_argument("--layers", type=int, default=6)
    demo = demo_setup(parser.parse_args())
    mesh = None
    if demo.launched:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(demo.device.type, (demo.world,))
    unit, unit_name = (GiB, "GiB") if demo.on_gpu else (MiB, "MiB")
    args = replace(demo.args, n_layers=demo.opts.layers)
    rows = []
    for count in range(args.n_layers // 2 + 1):  # every other block, a kept one above each
        apply = partial(apply_activation_offload, count=count) if count else (lambda model: None)
        kept = measure_step_memory(demo, args, mesh, apply)
        rows.append([count, in_units(kept["device"], unit), in_units(kept["host"], unit)])
    if demo.rank == 0:
        print(f"{demo.setting}, {args.n_layers} layers{', FSDP' if mesh else ''}")
        print(f"per rank, {unit_name}: {step_memory_meaning(demo.on_gpu)}; host: the "
              f"offloader's host buffers")
        print_table(["offloaded blocks", "device", "host"], rows, [16, 10, 10])
    end_ranks()


if __name__ == "__main__":
    main()
