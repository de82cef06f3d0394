"""08 - The optimizer step behind the next forward: AdamW while the tensor cores compute.

The problem in bytes. AdamW does little arithmetic per byte. Fused, it reads each fp32 weight,
its gradient and Adam's two moments, and writes back the weight, the moments and (with the
clip) the gradient: 32 bytes per parameter. Llama-3-8B: 257 GB a step, at least 54 ms at an
H200's 4.8 TB/s, in which the tensor cores have nothing to do (docs/results.md measures it).
The forward that follows is the opposite, compute-bound at these lengths.

The idea. A block's new weights are first needed when its next forward gathers them (FSDP's
unshard). So the update runs unit by unit, FSDP's units in forward order (the root: embeddings,
final norm and lm_head; then block 0, 1, ...), on a side CUDA stream, queued as soon as the
gradient norm is known. Each unit's next forward waits for its own update alone, and only then
lets its gradients go: block 5 updates while blocks 0-4 compute. What the forward still waits
for is the root's update and block 0's, 16% of Llama-3-8B's parameters. The arithmetic is
AdamW's own, the same fused kernel with the same clip (`grad_scale`) and the same skip of a
non-finite step (`found_inf`), on the same tensors: the weights are bit for bit those of the
step taken at once.

The price in bytes: a unit's gradients stay until its next forward, not the end of the step,
so the forward holds the gradients of the blocks it has not reached yet (4 bytes per parameter,
0.81 GiB per Llama-3-8B block on one GPU). A plan that peaks at the end of forward, where all
of them are gone, does not grow; plan.py counts them at each point of the forward.

On the CPU there is no second stream: each unit's update runs in that unit's pre-forward hook,
the order of events the GPU's streams keep. The first step allocates Adam's moments and runs
at once.

    python 08_optimizer_overlap.py                 # CPU: when each unit updates and lets go
    torchrun --nproc-per-node 1 train.py --model llama3-8b --seq-len 16K --overlap-optimizer
"""

from contextlib import contextmanager
from functools import partial

import torch

# What AdamW.step reads from the optimizer besides its groups: the clip's divisor (grad_scale) and
# the flag that skips a non-finite step (found_inf), set by train.clipped_step around step().
STEP_INPUTS = ("grad_scale", "found_inf")


class AdamWBehindForward(torch.optim.AdamW):
    """Fused AdamW whose step() queues each FSDP unit's update behind that unit's next forward.

    `model` is the Transformer (sharded or not): its units are the root's own parameters, then
    each block's. settle() finishes every queued update: before the weights or the state are
    read outside a forward (a save, an export, the run's end)."""

    def __init__(self, model, **adamw_settings):
        super().__init__(model.parameters(), fused=True, **adamw_settings)
        blocks = list(model.layers)
        in_blocks = {id(p) for block in blocks for p in block.parameters()}
        root = [p for p in model.parameters() if id(p) not in in_blocks]
        self.units = [(model, root)] + [(block, list(block.parameters())) for block in blocks]
        on_gpu = next(model.parameters()).is_cuda
        self.stream = torch.cuda.Stream() if on_gpu else None
        self.queued = {}  # unit -> the event its update ends with on the side stream (GPU), or
        # None (CPU: not run yet)
        self.inputs = None  # what the queued updates use, as step() saw them: the step's
        # inputs (STEP_INPUTS' tensors, read on the side stream until every unit waited) and
        # each group's settings (its learning rate)
        self.events = None  # a list to record "update UNIT" / "forward UNIT" in (tests, demo)
        for unit, (module, _) in enumerate(self.units):
            # prepend: before FSDP's own pre-forward, which gathers the unit's weights
            module.register_forward_pre_hook(partial(self.before_forward, unit), prepend=True)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("AdamWBehindForward.step takes no closure (it queues the update)")
        self.settle()  # a second step() with no forward between: the queued updates first
        if not self.state:  # the first step allocates Adam's moments: at once, on this stream
            return self.adamw_step()
        self.inputs = ({name: getattr(self, name) for name in STEP_INPUTS if hasattr(self, name)},
                       [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups])
        if self.stream is None:  # CPU: each unit's update runs in its pre-forward
            self.queued = dict.fromkeys(range(len(self.units)))
            return None
        self.stream.wait_stream(torch.cuda.current_stream())  # the gradients and clip are done
        for unit in range(len(self.units)):
            self.queue(unit)
        return None

    def queue(self, unit: int) -> None:
        """The unit's update on the side stream (GPU), and the event its forward waits for."""
        with torch.cuda.stream(self.stream):
            self.update(unit)
            self.queued[unit] = self.stream.record_event()

    def before_forward(self, unit: int, module=None, args=None) -> None:
        """The unit's update done before its forward reads the weights (on the GPU: the
        compute stream and FSDP's gather wait for its event); then its gradients go."""
        if unit in self.queued:
            event = self.queued.pop(unit)
            if event is None:  # CPU
                self.update(unit)
            else:
                torch.cuda.current_stream().wait_event(event)
                if module is not None:  # in a forward (from settle() the compute stream's
                    # wait suffices: FSDP's next root pre-forward makes its gather streams wait
                    # for it, and they may not exist yet)
                    gather_stream(self.units[unit][0]).wait_event(event)
            for p in self.units[unit][1]:
                p.grad = None
            if not self.queued:  # (the side stream is past its last read of the inputs)
                self.inputs = None
        if self.events is not None and module is not None:
            self.events.append(f"forward {unit}")

    def update(self, unit: int) -> None:
        """AdamW's step over one unit's parameters, with the inputs step() saw: AdamW's own
        step function, each group cut to the unit for one call."""
        if self.events is not None:
            self.events.append(f"update {unit}")
        with only(self, self.units[unit][1], *self.inputs):
            self.adamw_step()

    def adamw_step(self) -> None:
        """AdamW's own step. PyTorch wraps a class's step in the optimizer's hooks and profiler
        range once an instance exists; this class's step() runs those, once a step, so AdamW's
        is called without them."""
        step = super().step.__func__
        (step.__wrapped__ if getattr(step, "hooked", False) else step)(self)

    def settle(self) -> None:
        """Every queued update done (the compute stream waits for it) and its gradients gone."""
        for unit in list(self.queued):
            self.before_forward(unit)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """A unit whose update is queued keeps its gradients: its next forward lets them go."""
        if not self.queued:
            super().zero_grad(set_to_none)

    def state_dict(self):
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.settle()
        super().load_state_dict(state_dict)


@contextmanager
def only(optimizer, params: list, step_inputs: dict, group_settings: list):
    """`optimizer` over `params` alone, its groups with `group_settings` and the step's inputs
    `step_inputs` (STEP_INPUTS), for the duration; then as it was."""
    ids = {id(p) for p in params}
    groups = [dict(group) for group in optimizer.param_groups]  # each group as it was
    before = {name: optimizer.__dict__.pop(name) for name in STEP_INPUTS
              if name in optimizer.__dict__}
    for group, settings in zip(optimizer.param_groups, group_settings):
        group.update(settings, params=[p for p in group["params"] if id(p) in ids])
    optimizer.__dict__.update(step_inputs)
    try:
        yield
    finally:
        for group, was in zip(optimizer.param_groups, groups):
            group.clear()
            group.update(was)
        for name in STEP_INPUTS:
            optimizer.__dict__.pop(name, None)
        optimizer.__dict__.update(before)


def gather_stream(module) -> torch.cuda.Stream:
    """The stream FSDP2 reads `module`'s shards on for its all-gather (FSDP2's private
    attribute); the compute stream without FSDP. FSDP2 gathers a unit in that unit's own
    pre-forward (it prefetches in forward only where set_modules_to_forward_prefetch asks), so
    08's hook, before it, is early enough."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return torch.cuda.current_stream()
    comm = getattr(module._get_fsdp_state(), "_comm_ctx", None)
    stream = getattr(comm, "all_gather_copy_in_stream", None)
    if stream is None:
        raise RuntimeError("08 waits FSDP2's all-gather copy-in stream for each update, and this "
                           "torch's FSDP2 has no _comm_ctx.all_gather_copy_in_stream: run with "
                           "--no-overlap-optimizer (a GPU run's plan takes 08 unless told)")
    return stream


def apply_optimizer_overlap(model, **adamw_settings) -> AdamWBehindForward:
    """The optimizer for `model` (already sharded), its step behind the next forward."""
    return AdamWBehindForward(model, **adamw_settings)


def settle(optimizer) -> None:
    """`optimizer`'s queued updates done, if it is 08's (train.py's loop, at its end)."""
    if isinstance(optimizer, AdamWBehindForward):
        optimizer.settle()


# ---- below: the demo -----------------------------------------------------------------------------

def main():
    """Three steps of a small model on the CPU: when each unit updates, when its gradients go."""
    from model import Transformer, get_model_args

    torch.manual_seed(0)
    args = get_model_args("tiny")
    model = Transformer(args)
    optimizer = apply_optimizer_overlap(model, lr=1e-3)
    optimizer.events = []
    tokens = torch.randint(0, args.vocab_size, (1, 65))
    positions = torch.arange(64).unsqueeze(0)
    plain_model = Transformer(args)  # the same weights, AdamW's step at once
    plain_model.load_state_dict(model.state_dict())
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-3, fused=True)
    print("unit 0 is the root (embeddings, final norm, lm_head), then the blocks. The first "
          "step updates at once (Adam's moments are allocated then); from the second on, each "
          "unit updates just before its next forward.")
    for step in range(3):
        optimizer.events.clear()
        loss = model(tokens[:, :-1], positions, tokens[:, 1:]) / 64
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        (plain_model(tokens[:, :-1], positions, tokens[:, 1:]) / 64).backward()
        plain.step()
        plain.zero_grad()
        kept = [p for _, params in optimizer.units for p in params if p.grad is not None]
        print(f"step {step}: loss {loss.item():.4f}; its forward ran: "
              f"{' '.join(optimizer.events)}" + ("; its step() updated at once" if step == 0
                                                 else ""))
        print(f"  after step(): {len(optimizer.queued)} units queued, {len(kept)} gradients "
              f"({sum(p.numel() for p in kept) * 4 / 2**20:.2f} MiB fp32) kept until their "
              f"unit's next forward")
    optimizer.settle()
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), plain_model.parameters()))
    print(f"after 3 steps, settled: the weights equal plain fused AdamW's bit for bit: {same}")


if __name__ == "__main__":
    main()
