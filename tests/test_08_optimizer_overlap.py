"""08: the optimizer step behind the next forward leaves the same weights and state, bit for bit,
updates each unit just before its forward, carries the clip and the skip of a non-finite step
with it, and the planner counts the gradients the forward holds."""

import importlib
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from ranks import run_ranks
from reference import TINY_4L, build_as_train, full, shard
from test_saved_state import _resume_equals_straight

import model as llama
import plan as planner
from support.config import Config, resolve_techniques
from support.runtime import Machine, setup_runtime

optimizer_overlap = importlib.import_module("08_optimizer_overlap")
train = importlib.import_module("train")

MODEL = TINY_4L
L = llama.get_model_args(MODEL).n_layers


def _run(**flags):
    """train.py's run of 4 steps: a clip small enough to clip every step, weight decay, and a
    learning rate that changes every step (a warm-up, then a cosine decay: each update must
    take its own step's rate, not the next one's)."""
    cfg = resolve_techniques(Config(model=MODEL, seq_len=32, batch_size=2, steps=4,
                                    grad_clip=0.05, weight_decay=0.1, warmup_steps=2,
                                    lr_schedule="cosine", device="cpu", **flags))
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
            # each rank's shard (09 keeps the blocks' on the host: compared there)
            assert torch.equal(shard(value).cpu(), shard(got.optimizer.state[b][key]).cpu()), \
                (what, key)


def _same_weights_as_the_step_at_once(cases, technique="overlap_optimizer",
                                      optimizer="AdamWBehindForward"):
    """Each case run with AdamW at once and with `technique` (08's, or 09's), whose optimizer
    is the class named `optimizer`: the same run, bit for bit."""
    for flags in cases:
        at_once = _run(**flags)
        behind = _run(**{technique: True}, **flags)
        assert type(behind.optimizer).__name__ == optimizer
        _assert_same_run(at_once, behind, flags)


# what --stack auto takes for Llama-3-8B at 16K on one H200, 08 with it: 03's offloaded
# checkpoints on some blocks (side streams of their own) and kept attention, 04's tiled loss, 05
AUTO_16K = {"fsdp": True, "offload": True, "tile_loss": True, "untied": True,
            "checkpoint_layers": 2, "keep_attention": True}


def test_the_weights_and_state_are_bit_for_bit_the_step_at_once():
    """One process, plain and under FSDP (with 03's checkpoints: the recompute runs a block's
    forward again; and the techniques auto takes with 08 at 16K): four clipped steps give the
    same losses, norms, weights and Adam state."""
    _same_weights_as_the_step_at_once([{}, {"fsdp": True}, {"fsdp": True, "checkpoint": True},
                                       AUTO_16K])


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
    model, rt, cfg = build_as_train(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                           fsdp=True, overlap_optimizer=True))
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
    assert optimizer.inputs is None  # the step's clip and found_inf tensors let go with the last


def test_the_clip_and_a_skipped_step_travel_with_the_queued_update():
    """A step whose gradient norm is not finite updates nothing, Adam's state and step count
    included, though the update runs in the next forward (after train_step's finally dropped
    the clip's tensors from the optimizer)."""
    model, rt, cfg = build_as_train(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                           overlap_optimizer=True))
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
    _resume_equals_straight(tmp_path, [{"overlap_optimizer": True, "lr_schedule": "cosine"},
                                       {"overlap_optimizer": True, "fsdp": True}])


def test_overlap_with_the_state_on_the_host_is_refused():
    with pytest.raises(ValueError, match="--overlap-optimizer .* --offload-model-state"):
        resolve_techniques(Config(model=MODEL, fsdp=True, offload_model_state=True,
                                  overlap_optimizer=True, device="cpu"))


def test_a_step_with_no_forward_between_runs_the_queued_updates_first():
    """step(), then step() again with no forward between (and a new learning rate): the queued
    updates run first with the rate they were queued with, as plain AdamW's would have; the
    second step has no gradients and changes nothing; then a forward and a third step: plain
    AdamW's weights and state."""
    _step_again_with_no_forward_between("overlap_optimizer")


def _step_again_with_no_forward_between(technique: str):
    """The check above for 08 or 09 (`technique`, Config's flag) against plain AdamW."""
    tokens = torch.randint(0, llama.get_model_args(MODEL).vocab_size, (2, 33))
    runs = []
    for flag in (None, True):
        model, rt, cfg = build_as_train(Config(model=MODEL, seq_len=32, batch_size=2,
                                               device="cpu", **{technique: flag}))
        optimizer = train.make_optimizer(model, cfg)
        for _ in range(2):  # the first step updates at once, the second is queued
            train.forward_backward(model, tokens, rt)  # (its backward too)
            optimizer.step()
            optimizer.zero_grad()
        for group in optimizer.param_groups:
            group["lr"] = 5e-3
        optimizer.step()  # no forward between
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
        optimizer_overlap.settle(optimizer)
        runs.append((model, optimizer))
    (plain, plain_optimizer), (behind, behind_optimizer) = runs
    for a, b in zip(plain.parameters(), behind.parameters()):
        assert torch.equal(a, b)
        for key, value in plain_optimizer.state[a].items():
            assert torch.equal(value, behind_optimizer.state[b][key]), key


def test_step_hooks_run_once_a_step():
    """PyTorch wraps AdamW.step in the optimizer's hooks once any AdamW exists in the process;
    08's per-unit updates call the step unwrapped, so a hook runs once per step() (a plain
    AdamW made first, as a script that builds both would)."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True)  # wraps AdamW.step
    model, rt, cfg = build_as_train(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                           overlap_optimizer=True))
    optimizer = train.make_optimizer(model, cfg)
    calls = []
    optimizer.register_step_post_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    for _ in range(3):
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
    optimizer.settle()
    assert len(calls) == 3


# The planner: the backward of a layer holds what 08's forward of it holds and more (the same
# activations below, the same gradients above, the root's, the block's backward), so 08 adds no
# moment; it adds the gradients above to 07's forward moments, which can outweigh a backward.
PLANNED = Config(model="llama3-8b", seq_len=16384, fsdp=True, checkpoint=True, tile_loss=True,
                 dtype="bfloat16", device="cpu")


@pytest.mark.parametrize("flags", [
    {"checkpoint_layers": 10}, {"checkpoint_layers": 4, "offload": True, "seq_len": 131072},
    {"checkpoint": False, "tile_loss": False, "seq_len": 4096}, {"fsdp": False, "seq_len": 8192},
    {"checkpoint_layers": 2, "grad_accum": 2}])
def test_the_planner_finds_no_new_peak_without_07(flags):
    at_once = planner.plan_memory(replace(PLANNED, **flags), 1)
    behind = planner.plan_memory(replace(PLANNED, overlap_optimizer=True, **flags), 1)
    assert behind["moments"] == at_once["moments"]


def test_the_planner_counts_the_gradients_07s_forward_holds():
    """With 07 (8 blocks from layer 10: the top one is layer 24), the forward of the top
    offloaded block holds the gradients of the 7 blocks above it, 4 bytes a parameter; the end
    of forward none."""
    cfg = replace(PLANNED, checkpoint_layers=10, offload_activations=8)
    args = llama.get_model_args(cfg.model)
    at_once = planner.plan_memory(cfg, 1)
    behind = planner.plan_memory(replace(cfg, overlap_optimizer=True), 1)
    block = (llama.num_params(args) - llama.num_params(replace(args, n_layers=0))) // 32
    for layer, above in ((24, 7), (25, 6)):
        moment = f"forward of layer {layer}"
        assert behind["moments"][moment]["model_state"] == \
            at_once["moments"][moment]["model_state"] + 4 * block * above
    assert behind["moments"]["end of forward (loss)"] == at_once["moments"]["end of forward (loss)"]
    first = planner.plan_memory(replace(cfg, overlap_optimizer=True), 1, adam_allocated=False)
    assert first["moments"] == planner.plan_memory(cfg, 1, adam_allocated=False)["moments"]


def test_auto_weighs_08_where_adamw_runs_on_the_gpu():
    """Left open, 08 is a setting the planner weighs by the predicted step (measured on an
    H100: 0.3-0.9% off a step, step_time.BESIDE_FORWARD_SHOWN): Llama-3-8B at 16K on one H200
    takes it, predicted about 1% faster than the same plan with AdamW at once; at 32K, 0.4%,
    less than OVERLAP_MIN_GAIN, it does not; --no-overlap-optimizer keeps it off; a GPU without
    speed rates (the memory-only choice) leaves it off; with the model state on the host or
    without FSDP it is never weighed."""
    one_h200 = Machine(gpus=1, gpu_mem=int(139.8 * 2**30), host_mem=125 * 2**30,
                       gpus_per_node=1, gpu_name="NVIDIA H200")
    auto = replace(PLANNED, stack="auto", checkpoint=False, tile_loss=False, attn_kernel="fa4")
    choice = planner.plan_run(auto, one_h200)
    assert choice.settings["overlap_optimizer"] is True
    assert choice.expected["step_s"] == choice.chosen.seconds  # what the run is held to
    assert "--overlap-optimizer" in choice.lines[0]
    at_once = planner.plan_run(replace(auto, overlap_optimizer=False), one_h200)
    assert at_once.chosen.cfg.overlap_optimizer is False
    assert "--overlap-optimizer" not in at_once.lines[0]
    assert 0.97 * at_once.chosen.seconds < choice.chosen.seconds < 0.995 * at_once.chosen.seconds
    unknown_gpu = replace(one_h200, gpu_name="NVIDIA Imaginary 80GB")
    assert not planner.plan_run(auto, unknown_gpu).chosen.cfg.overlap_optimizer
    on_host = replace(auto, offload_model_state=True)
    assert not any(c.overlap_optimizer for c in planner.candidate_configs(on_host, 1))
    no_fsdp = replace(PLANNED, fsdp=False, checkpoint=True, tile_loss=False, attn_kernel="fa4")
    assert not any(c.overlap_optimizer for c in planner.candidate_configs(no_fsdp, 1))
    # where it would take less than OVERLAP_MIN_GAIN off (Llama-3-8B at 32K: 0.4%): a tie, off
    # (09 held out: left open there, --stack auto takes 09, which runs 08's updates)
    at_32k = planner.plan_run(replace(auto, seq_len=32768, offload_moments=False), one_h200)
    assert not at_32k.chosen.cfg.overlap_optimizer
    with_08 = planner.plan_run(replace(auto, seq_len=32768, offload_moments=False,
                                       overlap_optimizer=True), one_h200)
    assert 0.99 * at_32k.chosen.seconds < with_08.chosen.seconds < at_32k.chosen.seconds
    # explicit techniques: 08 left open is among the plan's settings, said in its line
    stack_5 = replace(PLANNED, stack=5, attn_kernel="fa4")
    explicit = planner.plan_run(stack_5, one_h200)
    assert explicit.settings["overlap_optimizer"] is True
    assert any("--overlap-optimizer" in line for line in explicit.lines)


def test_auto_keeps_adam_on_the_gpu_with_08():
    """--stack auto never pairs 08 with the model state on the host (AdamW would run there)."""
    cfg = replace(PLANNED, stack="auto", checkpoint=False, tile_loss=False, seq_len=262144,
                  overlap_optimizer=True)
    assert not any(c.offload_model_state for c in planner.candidate_configs(cfg, 1))


GPU_MODEL = "tiny-hd64-4L"
llama.PRESETS[GPU_MODEL] = replace(llama.get_model_args("tiny-hd64"), n_layers=4)


@pytest.mark.gpu
def test_gpu_updates_behind_the_forward_are_the_step_at_once():
    run_ranks(1, _gpu_behind_the_forward, backend="nccl")


@pytest.mark.gpu
def test_gpu_updates_behind_the_forward_on_2_ranks():
    """FSDP over 2 NCCL ranks (sharing one GPU where there is one): FSDP2 gathers each unit on
    its copy-in stream, which must wait for that unit's update; with every update delayed, the
    same weights and Adam state bit for bit as the step at once."""
    run_ranks(2, _gpu_delayed_updates_are_the_step_at_once, backend="nccl")


@pytest.mark.gpu
def test_gpu_updates_behind_the_forward_with_auto_s_16k_techniques():
    """One rank with the techniques --stack auto takes with 08 for Llama-3-8B at 16K (03's
    offload copies on their own side streams beside 08's): with every update delayed, the same
    bits as the step at once."""
    run_ranks(1, _gpu_delayed_updates_are_the_step_at_once, AUTO_16K, backend="nccl")


def _gpu_delayed_updates_are_the_step_at_once(flags=None):
    cfg = resolve_techniques(Config(model=GPU_MODEL, seq_len=256, batch_size=1,
                                    steps=4, device="cuda", dtype="bfloat16", grad_clip=0.05,
                                    attn_kernel="math",  # deterministic: bit for bit
                                    warmup_steps=2, lr_schedule="cosine",
                                    overlap_optimizer=False,  # (left open, a GPU plans 08)
                                    **(flags or {"fsdp": True})))
    at_once = train.train(cfg)
    assert not isinstance(at_once.optimizer, optimizer_overlap.AdamWBehindForward)
    with delayed_updates():
        _assert_same_run(at_once, train.train(replace(cfg, overlap_optimizer=True)), "2 ranks")


CYCLES = int(2e7)  # torch.cuda._sleep's unit: GPU cycles (~10-20 ms at 1-2 GHz)


@contextmanager
def delayed_updates(last_longer: int = 1):
    """Each unit's update queued behind ~10-20 ms of sleep on the side stream (the last
    block's `last_longer` times that): a missing wait would read weights not yet updated."""
    real_update = optimizer_overlap.AdamWBehindForward.update

    def delayed_update(self, unit):
        if self.stream is not None and torch.cuda.current_stream() == self.stream:
            torch.cuda._sleep(CYCLES * (last_longer if unit == L else 1))
        real_update(self, unit)

    optimizer_overlap.AdamWBehindForward.update = delayed_update
    try:
        yield
    finally:
        optimizer_overlap.AdamWBehindForward.update = real_update


def _gpu_behind_the_forward():
    """bf16 on the GPU, FSDP on one rank: with every unit's update delayed on the side stream
    (~20 ms of sleep before each), four steps give the same weights and Adam state bit for bit
    as the step at once; and the update does run beside the forward: block 0's forward has
    finished while the last block's update, slept longer, has not."""
    cfg = resolve_techniques(Config(model=GPU_MODEL, fsdp=True, seq_len=256, batch_size=2,
                                    steps=4, device="cuda", dtype="bfloat16", grad_clip=0.05,
                                    attn_kernel="math",  # deterministic: bit for bit
                                    warmup_steps=2, lr_schedule="cosine",
                                    overlap_optimizer=False))  # (left open, a GPU plans 08)
    at_once = train.train(cfg)
    assert not isinstance(at_once.optimizer, optimizer_overlap.AdamWBehindForward)
    with delayed_updates(last_longer=10):
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
