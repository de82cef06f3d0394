"""08: the optimizer step behind the next forward leaves the same weights and state, bit for bit,
updates each unit just before its forward, carries the clip and the skip of a non-finite step
with it, and the planner counts the gradients the forward holds."""

import importlib
from dataclasses import replace

import pytest
import torch
from ranks import run_ranks
from reference import TINY_4L, full
from test_saved_state import _resume_equals_straight

import model as llama
import plan as planner
from support.config import Config, resolve_techniques
from support.runtime import setup_runtime

optimizer_overlap = importlib.import_module("08_optimizer_overlap")
train = importlib.import_module("train")

MODEL = TINY_4L
L = llama.get_model_args(MODEL).n_layers


def _run(**flags):
    """train.py's run of 4 steps: a clip small enough to clip every step, weight decay."""
    cfg = resolve_techniques(Config(model=MODEL, seq_len=32, batch_size=2, steps=4,
                                    grad_clip=0.05, weight_decay=0.1, device="cpu", **flags))
    return train.train(cfg)


def _assert_same_run(want, got, what):
    assert [h["loss"] for h in got.history] == [h["loss"] for h in want.history], what
    assert [h["grad_norm"] for h in got.history] == [h["grad_norm"] for h in want.history], what
    assert all(h["grad_norm"] > 0.05 for h in want.history), "the clip never clipped"
    for (name, a), b in zip(want.model.named_parameters(), got.model.parameters()):
        assert torch.equal(full(a), full(b)), (what, name)
        assert b.grad is None, (what, name)  # settled: every unit's gradients went
    assert not got.optimizer.queued, what
    for a, b in zip(want.model.parameters(), got.model.parameters()):
        for key, value in want.optimizer.state[a].items():
            assert torch.equal(full(value), full(got.optimizer.state[b][key])), (what, key)


def _same_weights_as_the_step_at_once(cases):
    for flags in cases:
        at_once = _run(**flags)
        behind = _run(overlap_optimizer=True, **flags)
        assert isinstance(behind.optimizer, optimizer_overlap.AdamWBehindForward)
        _assert_same_run(at_once, behind, flags)


def test_the_weights_and_state_are_bit_for_bit_the_step_at_once():
    """One process, plain and under FSDP (with 03's checkpoints: the recompute runs a block's
    forward again): four clipped steps give the same losses, norms, weights and Adam state."""
    _same_weights_as_the_step_at_once([{}, {"fsdp": True}, {"fsdp": True, "checkpoint": True}])


def test_the_weights_are_the_step_at_once_on_2_and_4_ranks():
    """FSDP + Ulysses on 2 ranks, and 05 with FSDP over dp 2 x sp 2 on 4 (each rank updates its
    shards: FSDP's gather of each unit must come after that unit's update)."""
    run_ranks(2, _same_weights_as_the_step_at_once, [{"fsdp": True, "ulysses": True}])
    run_ranks(4, _same_weights_as_the_step_at_once, [{"stack": 5, "sp": 2}])


def test_each_unit_updates_just_before_its_next_forward():
    """The first step updates at once (it allocates Adam's moments); from the second on, step()
    queues every unit, and unit u (the root, then each block) updates right before its own
    forward, after the units below it ran theirs. Until then it keeps its gradients; the blocks
    above the running one still hold theirs."""
    cfg = resolve_techniques(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                    fsdp=True, overlap_optimizer=True))
    rt = setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    optimizer = train.make_optimizer(model, cfg)
    optimizer.events = []
    held = {}  # block -> whether each block held gradients as that block's forward began

    def after_the_hook(block, module, args):
        held.setdefault(block, [any(p.grad is not None for p in b.parameters())
                                for b in model.layers])

    for block, module in enumerate(model.layers):
        module.register_forward_pre_hook(lambda m, a, block=block: after_the_hook(block, m, a))
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    for step in range(4):
        optimizer.events.clear()
        held.clear()
        loss = train.forward_backward(model, tokens, rt)
        assert all(p.grad is not None for p in model.parameters())
        forwards = [f"forward {u}" for u in range(L + 1)]
        if step < 2:  # nothing queued before this forward: the last step ran at once
            assert optimizer.events == forwards
            assert all(held[block] == [False] * L for block in range(L))
        else:
            first = [e for i, e in enumerate(optimizer.events) if e not in optimizer.events[:i]]
            assert first == [f"{what} {u}" for u in range(L + 1)
                             for what in ("update", "forward")], first
            for block in range(L):
                assert held[block] == [b > block for b in range(L)], (step, block, held[block])
        train.clipped_step(model, optimizer, loss, max_norm=1.0)
        if step == 0:  # Adam's moments allocated: at once, the gradients gone
            assert not optimizer.queued and all(p.grad is None for p in model.parameters())
        else:
            assert sorted(optimizer.queued) == list(range(L + 1))
            assert all(p.grad is not None for p in model.parameters())  # kept for the update
    optimizer.settle()
    assert not optimizer.queued and all(p.grad is None for p in model.parameters())


def test_the_clip_and_a_skipped_step_travel_with_the_queued_update():
    """A step whose gradient norm is not finite updates nothing, Adam's state and step count
    included, though the update runs in the next forward (after train_step's finally dropped
    the clip's tensors from the optimizer)."""
    cfg = resolve_techniques(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                    overlap_optimizer=True))
    rt = setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    optimizer = train.make_optimizer(model, cfg)
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    for _ in range(2):  # Adam's moments exist: the next step is queued
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
    optimizer.settle()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = {n: {k: v.clone() for k, v in optimizer.state[p].items()}
             for n, p in model.named_parameters()}
    loss = train.forward_backward(model, tokens, rt)
    next(model.parameters()).grad[0] = float("inf")
    norm = train.clipped_step(model, optimizer, loss, 1.0)
    assert not torch.isfinite(norm) and optimizer.queued
    assert not hasattr(optimizer, "found_inf") and not hasattr(optimizer, "grad_scale")
    optimizer.settle()
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, state[name][key]), (name, key)


def test_a_run_saved_with_updates_queued_resumes_exactly(tmp_path):
    """A save after a step whose updates are still queued (the optimizer's state_dict settles
    them first), resumed: the same losses, weights and Adam state as the run straight through."""
    _resume_equals_straight(tmp_path, [{"overlap_optimizer": True},
                                       {"overlap_optimizer": True, "fsdp": True}])


def test_overlap_with_the_state_on_the_host_is_refused():
    with pytest.raises(ValueError, match="--overlap-optimizer .* --offload-model-state"):
        resolve_techniques(Config(model=MODEL, fsdp=True, offload_model_state=True,
                                  overlap_optimizer=True, device="cpu"))


def test_the_planner_counts_the_gradients_the_forward_holds():
    """Llama-3-8B at 16K on one GPU, 10 of 32 blocks checkpointed: the forward of layer 0 holds
    the gradients of blocks 1-31, the last checkpointed block's those of the 22 above it, each
    4 bytes a parameter; the end of forward none. That plan peaks later: the peak is the same."""
    cfg = Config(model="llama3-8b", seq_len=16384, fsdp=True, checkpoint=True,
                 checkpoint_layers=10, tile_loss=True, dtype="bfloat16", device="cpu")
    args = llama.get_model_args(cfg.model)
    at_once = planner.plan_memory(cfg, 1)
    behind = planner.plan_memory(replace(cfg, overlap_optimizer=True), 1)
    block = (llama.num_params(args) - llama.num_params(replace(args, n_layers=0))) // 32
    state = at_once["moments"]["end of forward (loss)"]["model_state"]
    assert behind["moments"]["forward of layer 0"]["model_state"] == state + 4 * block * 31
    assert behind["moments"]["forward of layer 9"]["model_state"] == state + 4 * block * 22
    assert behind["moments"]["end of forward (loss)"] == at_once["moments"]["end of forward (loss)"]
    assert behind["peak"] == at_once["peak"] and behind["peak_moment"] == at_once["peak_moment"]
    # The first step updates at once: nothing held in its forward
    first = planner.plan_memory(replace(cfg, overlap_optimizer=True), 1, adam_allocated=False)
    assert "forward of layer 0" not in first["moments"]


GPU_MODEL = "tiny-hd64-4L"
llama.PRESETS[GPU_MODEL] = replace(llama.get_model_args("tiny-hd64"), n_layers=4)


@pytest.mark.gpu
def test_gpu_updates_behind_the_forward_are_the_step_at_once():
    run_ranks(1, _gpu_behind_the_forward, backend="nccl")


def _gpu_behind_the_forward():
    """bf16 on the GPU, FSDP on one rank: with every unit's update delayed on the side stream
    (~20 ms of sleep before each), four steps give the same weights and Adam state bit for bit
    as the step at once; and the update does run beside the forward: block 0's forward has
    finished while the last block's update, slept longer, has not."""
    cfg = resolve_techniques(Config(model=GPU_MODEL, fsdp=True, seq_len=256, batch_size=2,
                                    steps=4, device="cuda", dtype="bfloat16", grad_clip=0.05))
    at_once = train.train(cfg)
    real_update = optimizer_overlap.AdamWBehindForward.update
    cycles = int(2e7)  # torch.cuda._sleep's unit: GPU cycles (~10-20 ms at 1-2 GHz)

    def delayed_update(self, unit, clip):
        if self.stream is not None:
            torch.cuda._sleep(cycles * (10 if unit == L else 1))  # on the side stream
        real_update(self, unit, clip)

    optimizer_overlap.AdamWBehindForward.update = delayed_update
    try:
        behind = train.train(replace(cfg, overlap_optimizer=True))
        _assert_same_run(at_once, behind, "delayed updates")
        model, optimizer = behind.model, behind.optimizer
        rt = setup_runtime(cfg)
        tokens = torch.randint(0, model.args.vocab_size, (2, cfg.seq_len + 1))
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
        last, seen = optimizer.queued[L], []  # the last block's update: slept 10 times longer

        def when_block_0_is_done(*_):  # the host waits for block 0's forward on the GPU
            done = torch.cuda.Event()
            done.record()
            done.synchronize()
            seen.append(last.query())

        hook = model.layers[0].register_forward_hook(when_block_0_is_done)
        train.forward_backward(model, tokens, rt)
        hook.remove()
        assert seen[0] is False  # block 0 computed while the side stream still updated
        optimizer.settle()
    finally:
        optimizer_overlap.AdamWBehindForward.update = real_update
