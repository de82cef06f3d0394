"""09 - Adam's moments in host memory, streamed through the GPU beside the forward.

The problem in bytes. Llama-3-8B on one H200 (139.8 GiB) holds 89.7 GiB of model state before
any activation: the fp32 weights (29.9 GiB) and AdamW's two moments (59.8). The moments are
read once a step, by the update, and 08 runs that update during the next forward, block by
block. For the rest of the step, the whole backward where the activations peak, they only wait.
At 32K tokens the backward's peak then leaves room for 8 of the 32 blocks' activations (2.9
GiB each, 07's count), so 03 checkpoints the other 24 and runs their forward twice.

The idea. A block's moments live in host memory; 08's update of that block, queued on its side
stream, is framed by two copies on two more streams: the moments come in just before it and go
back just after (the GPU's copy engines, one each way, beside its compute). The blocks' updates
follow one another, so three blocks' moments (slots) on the GPU at a time keep both copy
engines busy. A block's update and its copies are queued only as the forward comes within three
blocks of it: a copy engine runs copies in the order they were queued, so a later copy (the next
step's tokens) would otherwise wait behind every block's moments. A block's moments, 1.6 GiB,
take each copy engine about as long as the block's forward at 32K, so the copies mostly hide
behind the forward that 08's updates already run beside. The root's moments (embeddings,
lm_head: 7.8 GiB) stay on the GPU: the forward waits for the root's update first, and would
wait for its copies too.

What it buys: 52 GiB of moments off the GPU from the end of one forward to the next, the
backward's peak among them: at 32K that is 23 more blocks' activations, one block checkpointed
instead of 24.
What it costs: the host holds the moments (pinned: registered in place, so no power-of-two
rounding), and the GPU three blocks' moments during the forward. The arithmetic is 08's: AdamW's
own fused kernel over the same values (copies are exact), so the weights are bit for bit those of
plain AdamW. Loading a saved state puts the blocks' moments straight into host memory
(PyTorch's Optimizer.load_state_dict would put each on its parameter's device first).

    --offload-moments   (implies 08's --overlap-optimizer; measured: docs/results.md)

    python 09_offload_moments.py                   # CPU: the bytes each step moves each way,
                                                   # and the weights bit for bit plain AdamW's
    torchrun --nproc-per-node 1 train.py --model llama3-8b --seq-len 32K --offload-moments
"""

import collections
import importlib
import weakref

import torch
from torch.distributed.tensor import DTensor

optimizer_overlap = importlib.import_module("08_optimizer_overlap")

MOMENTS = ("exp_avg", "exp_avg_sq")
SLOTS = 3  # blocks' moments on the GPU at a time: one coming in, one updating, one going back


class AdamWMomentsOnHost(optimizer_overlap.AdamWBehindForward):
    """08's AdamW (each unit's update behind its next forward) whose blocks' moments stay in
    host memory between updates: `state[p]` holds the host tensors, and for a block's update
    they are copied into one of `slot_count` GPU buffers, updated there and copied back."""

    def __init__(self, model, slot_count: int = SLOTS, **adamw_settings):
        super().__init__(model, **adamw_settings)
        if self.defaults["amsgrad"]:
            raise ValueError("09 streams AdamW's two moments; amsgrad keeps a third")
        on_gpu = self.stream is not None
        self.copy_in = torch.cuda.Stream() if on_gpu else None  # host -> GPU: one copy engine
        self.copy_out = torch.cuda.Stream() if on_gpu else None  # GPU -> host: the other
        self.slot_count = slot_count
        self.slots = None  # this step's GPU buffers, one block's moments each (step() to the
        # last block's update)
        self.slot_free = [None] * slot_count  # each slot's last copy out (an event; None: CPU)
        self.host = {}  # a block's parameter -> its moments in host memory (MOMENTS order),
        # of its kind (the state's)
        self.host_blocks = {}  # a block's unit -> all its moments, one flat host tensor that
        # the copies move whole: one copy a block each way, not one per tensor ...
        self.host_parts = {}  # ... and their plain views into it (to_local() costs host time)
        self.pinned = []  # the host memory page-locked for them (pointers)
        weakref.finalize(self, unpin, self.pinned)
        self.moved = {"in": 0, "out": 0}  # bytes copied each way since created (tests, demo)
        self.deferred = collections.deque()  # the blocks whose update waits for the forward
        # to come near (GPU)

    def update(self, unit: int) -> None:
        """08's update of one unit; a block's moments come in before it and go back after."""
        if unit == 0:
            return super().update(unit)  # the root's moments stay on the GPU
        params = self.units[unit][1]
        slot = (unit - 1) % self.slot_count
        host = self.host_blocks[unit]
        gpu = self.slots[slot][:host.numel()]
        arrived = copy_on(host, gpu, self.copy_in, after=self.slot_free[slot])
        if arrived is not None:
            self.stream.wait_event(arrived)
        # each moment's place in the slot, as the state's kind of tensor
        moments = views_of(gpu, self.host_parts[unit])
        self.set_moments(params, [like(p, m) for p, m in zip(twice(params), moments)])
        super().update(unit)  # AdamW's own fused step, over the GPU copies
        self.set_moments(params, [m for p in params for m in self.host[p]])
        self.slot_free[slot] = copy_on(gpu, host, self.copy_out, after=record(self.stream))
        if self.copy_in is not None:  # the slot's memory is reused only after these streams
            for stream in (self.copy_in, self.stream, self.copy_out):
                self.slots[slot].record_stream(stream)
        self.moved["in"] += host.nbytes
        self.moved["out"] += host.nbytes
        if unit == len(self.units) - 1:
            self.slots = None  # the step's last update: the slots go (once the streams allow)

    def set_moments(self, params: list, moments: list) -> None:
        """`state[p]`'s moments, for each of `params`, are `moments` (MOMENTS order)."""
        for i, p in enumerate(params):
            self.state[p].update(zip(MOMENTS, moments[len(MOMENTS) * i:len(MOMENTS) * (i + 1)]))

    @torch.no_grad()
    def step(self, closure=None):
        self.settle()  # a second step() with no forward between: the queued updates first,
        # before the slots are made again (the last update lets them go)
        if not self.state:  # unlike 08's, the first step streams: the moments start on the host
            self.create_state()
        slot_numel = max(flat.numel() for flat in self.host_blocks.values())
        weight = self.units[0][1][0]  # (the moments take their parameters' dtype: fp32 under
        # FSDP, and device)
        self.slots = [torch.empty(slot_numel, dtype=weight.dtype, device=weight.device)
                      for _ in range(self.slot_count)]
        if self.copy_in is not None:  # the slots' memory was the compute stream's until now,
            # and the host moments were last written by the previous step's copies out
            self.copy_in.wait_stream(torch.cuda.current_stream())
            self.copy_in.wait_stream(self.copy_out)
        return super().step(closure)  # 08's: each unit's update through queue() (GPU) or in
        # its pre-forward (CPU)

    def queue(self, unit: int) -> None:
        """08's, but a block's update (and its copies) only once the forward is within
        `slot_count` blocks of it (before_forward queues the rest): copies queued far ahead on
        a copy stream hold up every later copy, the compute stream's too (the next step's
        tokens would wait behind all the blocks' moments, the forward idle)."""
        if unit == 0:  # the root: no copies, and the forward waits for it first
            return super().queue(unit)
        self.deferred.append(unit)

    def before_forward(self, unit: int, module=None, args=None) -> None:
        """08's, once the updates of the blocks up to `slot_count` past this unit are queued."""
        self.queue_deferred(up_to=unit + self.slot_count)
        super().before_forward(unit, module, args)

    def queue_deferred(self, up_to: int) -> None:
        """08's queue (not this class's, which defers) for each deferred block up to `up_to`."""
        while self.deferred and self.deferred[0] <= up_to:
            super().queue(self.deferred.popleft())

    def create_state(self) -> None:
        """AdamW's state before its first step, zero as its own: the root's moments on the
        GPU, the blocks' in host memory."""
        for unit, (_, params) in enumerate(self.units):
            for p in params:
                moments = ([torch.zeros_like(p) for _ in MOMENTS] if unit == 0
                           else self.host_moments(unit)[p])
                # fused AdamW keeps its step count on the parameter's device, in fp32
                self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                 **dict(zip(MOMENTS, moments))}

    def host_moments(self, unit: int) -> dict:
        """The block's moments in host memory, zero, each of its parameter's kind (a DTensor
        laid out as it is): views into one flat tensor. On a GPU machine page-locked in place
        (cudaHostRegister, as PyTorch's checkpoint staging does): the copy engines then read
        and write it directly, and unlike a pinned allocation, rounded up to a power of two
        (base/host_buffers.py), it takes exactly its bytes."""
        params = self.units[unit][1]
        if unit not in self.host_blocks:
            parts = [local(p) for p in twice(params)]
            flat = torch.zeros(sum(part.numel() for part in parts), dtype=parts[0].dtype)
            if parts[0].is_cuda and flat.nbytes:
                self.pinned.append(pin_in_place(flat))
            self.host_blocks[unit], self.host_parts[unit] = flat, views_of(flat, parts)
            moments = [like(p, m) for p, m in zip(twice(params), self.host_parts[unit])]
            for i, p in enumerate(params):
                self.host[p] = moments[len(MOMENTS) * i:len(MOMENTS) * (i + 1)]
        return {p: self.host[p] for p in params}

    def settle(self) -> None:
        """08's settle (every queued update done), and the moments back on the host (the host
        reads them next: a save, the run's end). At a step's start those copies ended during
        the last forward."""
        self.queue_deferred(up_to=len(self.units))
        super().settle()
        if self.copy_out is not None:
            self.copy_out.synchronize()

    def load_state_dict(self, state_dict) -> None:
        """AdamW's load for all but the blocks' moments, which go straight into their host
        tensors (AdamW's own load would put every moment on its parameter's device, and a GPU
        that needs 09 may have no room for them all: Llama-3-8B on one 80 GB GPU), once the
        last step's copies there are done (08's load settles)."""
        unit_of = {id(p): unit for unit, (_, params) in enumerate(self.units) for p in params}
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        param_of = dict(zip(saved, [p for group in self.param_groups for p in group["params"]]))
        kept, held = {}, {}
        for key, entry in state_dict["state"].items():  # (keyed as AdamW's load keys them)
            p = param_of[key]
            kept[key] = {k: v for k, v in entry.items() if unit_of[id(p)] == 0 or k not in MOMENTS}
            if unit_of[id(p)]:
                held[p] = [entry[name] for name in MOMENTS]
        super().load_state_dict({**state_dict, "state": kept})
        for p, values in held.items():
            host = self.host_moments(unit_of[id(p)])[p]
            for into, value in zip(host, values):
                local(into).copy_(local(value))
            self.set_moments([p], host)


def copy_on(source: torch.Tensor, target: torch.Tensor, stream, after=None):
    """`source` into `target` on `stream` (a copy engine) once the event `after` is past; the
    event at the copy's end. On the CPU (stream None): at once, None."""
    if stream is None:
        target.copy_(source)
        return None
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        target.copy_(source, non_blocking=True)
    return stream.record_event()


def record(stream):
    """An event at `stream`'s end (None on the CPU)."""
    return None if stream is None else stream.record_event()


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard (FSDP2's parameters), else `t`."""
    return t.to_local() if isinstance(t, DTensor) else t


def like(p: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """`part` (p's local shape) as a tensor of p's kind: a DTensor laid out as p is, wherever
    `part` lives (DTensor.from_local would move a host part to the GPU: FSDP2 wraps its host
    shards this way for the same reason), or `part` itself."""
    if not isinstance(p, DTensor):
        return part
    return DTensor(part, p._spec, requires_grad=False)


def views_of(slot: torch.Tensor, parts: list) -> list:
    """A view into `slot` shaped as each of `parts`, one after another."""
    views, start = [], 0
    for part in parts:
        views.append(slot[start:start + part.numel()].view(part.shape))
        start += part.numel()
    return views


def twice(params: list) -> list:
    """Each parameter once per moment (MOMENTS order, parameter by parameter)."""
    return [p for p in params for _ in MOMENTS]


def pin_in_place(t: torch.Tensor) -> int:
    """Page-lock `t`'s memory for the GPU's copy engines; its address (for unpin)."""
    pointer = t.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(pointer, t.nbytes, 0)) != 0:
        raise RuntimeError("09 could not page-lock host memory for Adam's moments "
                           "(cudaHostRegister failed): is the locked-memory limit (ulimit -l) "
                           "too low, or the host's memory short?")
    return pointer


def unpin(pointers: list) -> None:
    """Undo pin_in_place for each address (the optimizer is going, its host tensors with it)."""
    for pointer in pointers:
        torch.cuda.cudart().cudaHostUnregister(pointer)


def apply_moments_offload(model, **adamw_settings) -> AdamWMomentsOnHost:
    """The optimizer for `model` (already sharded): 08's, its blocks' moments on the host."""
    return AdamWMomentsOnHost(model, **adamw_settings)


# ---- below: the demo -----------------------------------------------------------------------------

def main():
    """Three steps of a small model on the CPU: the bytes moved, and the weights against plain
    fused AdamW's."""
    from model import Transformer, get_model_args

    torch.manual_seed(0)
    args = get_model_args("tiny")
    model = Transformer(args)
    optimizer = apply_moments_offload(model, lr=1e-3)
    plain_model = Transformer(args)  # the same weights, AdamW's step at once
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, args.vocab_size, (1, 65))
    positions = torch.arange(64).unsqueeze(0)
    block_moments = sum(p.numel() for block in model.layers for p in block.parameters()) * 8
    print(f"the blocks' moments: {block_moments / 2**20:.2f} MiB in host memory; the root's stay "
          f"with the weights. On the CPU each block's update runs in its next forward (08), "
          f"with no streams: what shows is the bytes each step copies and the weights.")
    for step in range(3):
        moved = dict(optimizer.moved)
        for m, opt in ((model, optimizer), (plain_model, plain)):
            (m(tokens[:, :-1], positions, tokens[:, 1:]) / 64).backward()
            opt.step()
            opt.zero_grad()
        ran = "the step before's updates, " if step else "no update (none queued yet); "
        print(f"step {step}: its forward ran {ran}the moments copied in "
              f"{(optimizer.moved['in'] - moved['in']) / 2**20:.2f} MiB and back "
              f"{(optimizer.moved['out'] - moved['out']) / 2**20:.2f} MiB; "
              f"{len(optimizer.queued)} units queued (the root and {len(optimizer.queued) - 1} "
              f"blocks)")
    optimizer.settle()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    print(f"after 3 steps, settled: the weights equal plain fused AdamW's bit for bit: {same}")


if __name__ == "__main__":
    main()
