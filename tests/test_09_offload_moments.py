"""09: the blocks' Adam moments in host memory, streamed through GPU slots for 08's updates,
leave the same weights and state bit for bit as plain AdamW; the moments do live on the host
(each step moves them in and out once, and the update sees only a slot's copy), and the
planner takes them off the GPU's peak."""

import copy
import importlib
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch
from ranks import run_ranks
from reference import build_as_train, full
from test_08_optimizer_overlap import (AUTO_16K, CYCLES, GPU_MODEL, MODEL, _assert_same_run,
                                       _same_weights_as_the_step_at_once,
                                       _step_again_with_no_forward_between)
from test_saved_state import _resume_equals_straight, _resume_through_nccl_on_the_gpu

import model as llama
import plan as planner
from support import byte_counts, step_time
from support.config import Config, resolve_techniques
from support.runtime import Machine

moments_offload = importlib.import_module("09_offload_moments")
train = importlib.import_module("train")

L = llama.get_model_args(MODEL).n_layers
STREAMED = ("offload_moments", "AdamWMomentsOnHost")  # 08's check of a run, with 09 on


def test_the_weights_and_state_are_bit_for_bit_plain_adamw():
    """One process, plain and under FSDP (and with the techniques auto takes with 08 at 16K):
    four clipped steps, a changing learning rate, weight decay: the same losses, norms, weights
    and Adam state (the blocks' read from the host) as fused AdamW at once."""
    _same_weights_as_the_step_at_once([{}, {"fsdp": True}, AUTO_16K], *STREAMED)


def test_the_weights_are_plain_adamw_s_on_2_and_4_ranks():
    """Each rank streams its own shards' moments (DTensors whose local parts live on the
    host): FSDP + Ulysses on 2 ranks, 05 over dp 2 x sp 2 on 4."""
    run_ranks(2, _same_weights_as_the_step_at_once, [{"fsdp": True, "ulysses": True}], *STREAMED)
    run_ranks(4, _same_weights_as_the_step_at_once, [{"stack": 5, "sp": 2}], *STREAMED)


def test_the_moments_live_on_the_host_and_each_update_sees_a_slot():
    """The blocks' moments in `state` are the host tensors between steps, from the first step
    on; each block's update reads and writes copies in one of the step's slots (never the
    host tensors, never a slot another block of the same round uses), and each step moves
    every block's moments in once and out once: 8 bytes a block parameter each way."""
    model, rt, cfg = build_as_train(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                           fsdp=True, offload_moments=True))
    optimizer = train.make_optimizer(model, cfg)
    assert isinstance(optimizer, moments_offload.AdamWMomentsOnHost) and cfg.overlap_optimizer
    seen = []  # (unit, the storages its moments were in during its update)
    real_step = optimizer.adamw_step

    def spying_step():
        params = optimizer.param_groups[0]["params"]  # the unit's, during 08's update
        unit = next(u for u, (_, ps) in enumerate(optimizer.units) if ps[0] is params[0])
        seen.append((unit, {full_storage(optimizer.state[p][name]) for p in params
                            for name in moments_offload.MOMENTS}))
        real_step()

    optimizer.adamw_step = spying_step
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    block_bytes = sum(moments_offload.local(p).numel() for b in model.layers
                      for p in b.parameters()) * 4 * 2
    for step in range(3):
        seen.clear()
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
        optimizer.settle()
        assert optimizer.moved == {"in": block_bytes * (step + 1),
                                   "out": block_bytes * (step + 1)}
        host = {full_storage(m) for ms in optimizer.host.values() for m in ms}
        assert [u for u, _ in seen] == list(range(L + 1))
        root, *blocks = [storages for _, storages in seen]
        assert not root & host  # the root's stay where they are
        for storages in blocks:
            assert len(storages) == 1 and not storages & host  # one slot, not the host's
        for i, storages in enumerate(blocks):  # the slots of one round differ
            assert all(storages != other for other in blocks[max(0, i - 2):i])
        for unit, (_, params) in enumerate(optimizer.units):
            for p in params:
                held = [optimizer.state[p][name] for name in moments_offload.MOMENTS]
                if unit:
                    assert all(a is b for a, b in zip(held, optimizer.host[p]))
                else:
                    assert p not in optimizer.host
    assert optimizer.slots is None  # released with the step's last update


def test_a_step_with_no_forward_between_runs_the_queued_updates_first():
    """step() again with no forward between: the queued updates, their moments streamed, run
    first; then a forward and a third step: plain AdamW's weights and state (test_08's check)."""
    _step_again_with_no_forward_between("offload_moments")


def test_state_dict_and_load_state_dict_round_trip_through_the_host(monkeypatch):
    """The optimizer's own state_dict, copied, loaded into a fresh 09 optimizer: its blocks'
    moments land in its host tensors, equal to the saved ones, without passing through
    AdamW's own load (which puts each on its parameter's device: on a GPU that 09 lets fit,
    no room for them all); the root's on the parameters' device."""
    given_to_adamw = []
    real_load = torch.optim.Optimizer.load_state_dict

    def recorded_load(self, state_dict):
        given_to_adamw.extend(name for entry in state_dict["state"].values() for name in entry
                              if name in moments_offload.MOMENTS)
        return real_load(self, state_dict)

    monkeypatch.setattr(torch.optim.Optimizer, "load_state_dict", recorded_load)
    model, rt, cfg = build_as_train(Config(model=MODEL, seq_len=32, batch_size=2, device="cpu",
                                           fsdp=True, offload_moments=True))
    optimizer = train.make_optimizer(model, cfg)
    tokens = torch.randint(0, model.args.vocab_size, (2, 33))
    for _ in range(2):
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
    state_dict = optimizer.state_dict()  # (its moments views into each block's host tensor)
    saved = {"state": {k: {name: v.clone() for name, v in entry.items()}
                       for k, entry in state_dict["state"].items()},
             "param_groups": copy.deepcopy(state_dict["param_groups"])}
    fresh = train.make_optimizer(model, cfg)
    fresh.load_state_dict(saved)
    for _, params in fresh.units[1:]:
        for p in params:
            for name, host in zip(moments_offload.MOMENTS, fresh.host[p]):
                assert fresh.state[p][name] is host
                assert torch.equal(full(host), full(optimizer.state[p][name])), name
    root = fresh.units[0][1]
    assert all(p not in fresh.host for p in root)
    assert len(given_to_adamw) == 2 * len(root)  # the root's moments alone


def full_storage(t):
    return moments_offload.local(t).untyped_storage().data_ptr()


def test_a_saved_run_resumes_exactly(tmp_path):
    """A save with updates queued (state_dict settles and waits for the copies back), resumed
    (load_state_dict sends the loaded moments back to the host): the same losses, weights and
    Adam state as the run straight through."""
    _resume_equals_straight(tmp_path, [{"offload_moments": True, "fsdp": True}])


@pytest.mark.gpu
def test_gpu_a_saved_run_resumes_exactly(tmp_path):
    """The same on 2 NCCL ranks and the GPU: the moments saved from page-locked host memory,
    loaded straight back into it (never all on the GPU), the run bit for bit the straight one."""
    run_ranks(2, _resume_through_nccl_on_the_gpu, str(tmp_path),
              [{"offload_moments": True, "fsdp": True}], backend="cpu:gloo,cuda:nccl")


@pytest.mark.parametrize("flags, message", [
    ({"overlap_optimizer": False}, "--offload-moments .* --no-overlap-optimizer"),
    ({"fsdp": True, "offload_model_state": True}, "--offload-moments .* --offload-model-state"),
])
def test_contradicting_flags_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        resolve_techniques(Config(model=MODEL, offload_moments=True, device="cpu", **flags))


def test_the_flag_implies_08():
    assert resolve_techniques(Config(model=MODEL, offload_moments=True,
                                     device="cpu")).overlap_optimizer


@pytest.mark.gpu
def test_gpu_streamed_moments_are_plain_adamw_and_on_the_host():
    run_ranks(1, _gpu_streamed_moments, backend="nccl")


@pytest.mark.gpu
def test_gpu_streamed_moments_on_2_ranks():
    run_ranks(2, _gpu_streamed_moments, backend="nccl")


@contextmanager
def slow_copies():
    """Each block's copy in queued behind ~10-20 ms of sleep on its stream (an update that did
    not wait for its moments would read a slot's stale bytes), each copy out behind four times
    that (a copy in that did not wait for its slot's last copy out, this step's or the last's,
    would overwrite moments not yet back on the host)."""
    real_copy = moments_offload.copy_on

    def slow_copy(source, target, stream, after=None):
        if stream is not None:
            if after is not None:
                stream.wait_event(after)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(CYCLES * (4 if target.is_cpu else 1))
        return real_copy(source, target, stream, after)

    moments_offload.copy_on = slow_copy
    try:
        yield
    finally:
        moments_offload.copy_on = real_copy


def _gpu_streamed_moments():
    """bf16 on the GPU, FSDP: with every copy slowed, four steps give the same weights and Adam
    state bit for bit as fused AdamW at once; the blocks' moments are page-locked host memory,
    and the GPU holds none of them after a step."""
    cfg = resolve_techniques(Config(model=GPU_MODEL, fsdp=True, seq_len=256, batch_size=2,
                                    steps=4, device="cuda", dtype="bfloat16", grad_clip=0.05,
                                    attn_kernel="math",  # deterministic: bit for bit
                                    warmup_steps=2, lr_schedule="cosine",
                                    overlap_optimizer=False))  # (left open, a GPU plans 08)
    at_once = train.train(cfg)
    with slow_copies():
        streamed = train.train(replace(cfg, offload_moments=True))
    _assert_same_run(at_once, streamed, "streamed")
    optimizer = streamed.optimizer
    for _, params in optimizer.units[1:]:
        for p in params:
            for m in optimizer.host[p]:
                local = moments_offload.local(m)
                assert local.device.type == "cpu" and local.is_pinned()
    # the GPU holds the root's moments alone, and the step's slots went with its last update
    block_moments = sum(moments_offload.local(p).numel() for _, ps in optimizer.units[1:]
                        for p in ps) * 8

    def on_gpu(opt):
        return sum(moments_offload.local(v).nbytes for state in opt.state.values()
                   for v in state.values() if moments_offload.local(v).is_cuda)

    assert on_gpu(at_once.optimizer) - on_gpu(optimizer) == block_moments
    assert optimizer.slots is None


@pytest.mark.gpu
def test_gpu_a_block_s_update_is_queued_as_the_forward_nears_it():
    run_ranks(1, _gpu_queued_as_the_forward_nears, backend="nccl")


def _gpu_queued_as_the_forward_nears():
    """On the GPU step() queues the root's update alone; the blocks' updates, and their copies,
    are queued as the forward comes within SLOTS blocks of them: copies queued further ahead
    held up later copies the same way, the compute stream's too (at 64K on one H100 the next
    step's tokens waited ~0.4 s for every block's moments, the GPU idle; docs/results.md)."""
    model, rt, cfg = build_as_train(Config(model=GPU_MODEL, seq_len=64, batch_size=1,
                                           device="cuda", dtype="bfloat16", fsdp=True,
                                           offload_moments=True))
    optimizer = train.make_optimizer(model, cfg)
    layers = len(model.layers)
    tokens = torch.randint(0, model.args.vocab_size, (1, 65))
    for step in range(3):
        optimizer.events = []
        train.clipped_step(model, optimizer, train.forward_backward(model, tokens, rt), 1.0)
        assert optimizer.events[-1:] == ["update 0"] and list(optimizer.queued) == [0]
        assert list(optimizer.deferred) == list(range(1, layers + 1))
        optimizer.events = []
        train.forward_backward(model, tokens, rt)
        updated = []
        for event in optimizer.events:
            what, unit = event.split()
            if what == "update":
                updated.append(int(unit))
            else:  # this unit's forward: the blocks up to SLOTS past it queued, none further
                assert updated == list(range(1, min(int(unit) + moments_offload.SLOTS,
                                                    layers) + 1)), (event, updated)
        optimizer.settle()
        optimizer.zero_grad()


# The planner: the blocks' moments leave every moment of the step but the forward's slots.
PLANNED = Config(model="llama3-8b", seq_len=32768, fsdp=True, checkpoint=True, tile_loss=True,
                 checkpoint_layers=20, dtype="bfloat16", device="cpu", overlap_optimizer=True)
ONE_H200 = Machine(gpus=1, gpu_mem=int(139.8 * 2**30), host_mem=125 * 2**30, gpus_per_node=1,
                   gpu_name="NVIDIA H200")


def test_the_planner_moves_the_blocks_moments_to_the_host():
    """Llama-3-8B on one GPU: 32 blocks of 218M parameters, 8 bytes each (1.62 GiB a block, 52
    GiB in all) leave the backward's moments for the host; the forward holds three blocks' in
    the slots (beside 08's held gradients at layer 0); the peak drops by the blocks' moments
    less the slots, at least."""
    args = llama.get_model_args("llama3-8b")
    block = 8 * byte_counts.block_params(args)
    kept = planner.plan_memory(PLANNED, 1)
    streamed = planner.plan_memory(replace(PLANNED, offload_moments=True), 1)
    assert streamed["host_parts"]["Adam's moments (09)"] == 32 * block
    assert streamed["host"] == kept["host"] + 32 * block
    for moment in ("backward of the last layer", "backward of layer 0", "end of backward"):
        assert (kept["moments"][moment]["model_state"]
                - streamed["moments"][moment]["model_state"]) == 32 * block, moment
    # the slots last until the next forward's last block has updated (and its copy out)
    moment = "end of forward (loss)"
    assert (kept["moments"][moment]["model_state"]
            - streamed["moments"][moment]["model_state"]) == 29 * block
    assert (streamed["moments"]["optimizer step"]["model_state"]
            == kept["moments"]["optimizer step"]["model_state"] - 29 * block)
    forward = streamed["moments"]["forward of layer 0 (09's moments streaming)"]
    assert forward["model_state"] == (streamed["moments"]["backward of layer 0"]["model_state"]
                                      + 3 * block)
    assert kept["peak"] - streamed["peak"] >= 29 * block
    assert "forward of layer 0 (09's moments streaming)" not in kept["moments"]


def test_the_first_step_with_09_plans_the_moments_already_made():
    """09 makes the moments on the host before the first step (adam_allocated=False), so that
    step's GPU holds the root's moments as every later one's: at the end of backward Llama-3-8B's
    fp32 parameters and gradients (4 + 4 bytes each) and the root's two fp32 moments."""
    args = llama.get_model_args("llama3-8b")
    n, root = llama.num_params(args), 2 * args.vocab_size * args.dim + args.dim
    first = planner.plan_memory(replace(PLANNED, offload_moments=True), 1, adam_allocated=False)
    assert first["moments"]["end of backward"]["model_state"] == 8 * n + 8 * root


def test_without_fsdp_the_streamed_moments_take_the_compute_dtype():
    """One process (no FSDP, no fp32 master state): the moments take the parameters' dtype, so
    in bf16 a Llama-3-8B block's two moments are 2 x 2 bytes for each of its 218,112,000
    parameters, on the host for all 32 blocks and in the slots for SLOTS of them."""
    args = llama.get_model_args("llama3-8b")
    block = 4 * 218_112_000
    assert byte_counts.streamed_moment_bytes(args, 1, fsdp=False, bytes_per_value=2) == {
        "block": block, "host": 32 * block, "slots": moments_offload.SLOTS * block}


def test_auto_takes_09_where_predicted_faster_and_checkpoints_fewer_blocks():
    """Left open, 09 is weighed after the plans without it: at 32K on one H200 it frees the room
    for all but one block's activations and is predicted faster than the best plan without it
    (whose 20 checkpointed blocks run their forward twice) by more than MOMENTS_MIN_GAIN, so
    --stack auto takes it and its line says why; at 16K a block's forward is shorter than its
    copies and it is not taken; given, it is the plan's; --no-offload-moments keeps it off."""
    auto = replace(PLANNED, stack="auto", checkpoint=False, tile_loss=False,
                   checkpoint_layers=None, overlap_optimizer=None, attn_kernel="fa4")
    assert not any(c.offload_moments for c in planner.candidate_configs(auto, 1))
    without = planner.plan_run(replace(auto, offload_moments=False), ONE_H200)
    given = planner.plan_run(replace(auto, offload_moments=True), ONE_H200)
    left_open = planner.plan_run(auto, ONE_H200)
    assert given.chosen.cfg.offload_moments and given.chosen.cfg.overlap_optimizer
    assert given.chosen.cfg.checkpoint_layers < without.chosen.cfg.checkpoint_layers
    assert given.chosen.seconds < (1 - planner.MOMENTS_MIN_GAIN) * without.chosen.seconds
    assert "--offload-moments" in given.lines[0]
    assert left_open.chosen.cfg == given.chosen.cfg
    assert "off the step of the fastest without it" in left_open.lines[0]
    assert not without.chosen.cfg.offload_moments
    short = planner.plan_run(replace(auto, seq_len=16384), ONE_H200)
    assert not short.chosen.cfg.offload_moments
    on_host = replace(auto, offload_moments=True, overlap_optimizer=None)
    assert all(c.offload_moments and c.overlap_optimizer
               for c in planner.candidate_configs(resolve_techniques(on_host), 1))


ONE_H100 = Machine(gpus=1, gpu_mem=int(79.2 * 2**30), host_mem=120 * 2**30, gpus_per_node=1,
                   gpu_name="NVIDIA H100 80GB HBM3")


def test_auto_takes_09_where_nothing_fits_without_it():
    """Llama-3-8B on one 80 GB GPU: its model state, 16 bytes a parameter, fills the GPU, and on
    the host (01's) it would need the whole host; with the blocks' moments on the host 8K
    fits, and --stack auto takes 09 there, saying why (and where the host could hold all the
    state, as the faster of the two). --no-offload-moments keeps it off: then nothing fits,
    and the message says what 09 would give; without the flag it names 09 for the longest that
    does."""
    auto = Config(model="llama3-8b", seq_len=8192, stack="auto", dtype="bfloat16",
                  attn_kernel="fa4", device="cpu")
    run = planner.plan_run(auto, ONE_H100)
    assert run.chosen.cfg.offload_moments and run.chosen.fits
    for weighed in run.ranking:  # each a run train.py would take (09 never with 01's host state)
        resolve_techniques(replace(weighed.cfg, device="cpu"))
    assert all(text in run.lines[0]
               for text in ("--offload-moments", "without it nothing fits"))
    with pytest.raises(ValueError, match="nothing fits") as refused:  # the flag still wins,
        planner.plan_run(replace(auto, offload_moments=False), ONE_H100)  # and says what it
    assert "--offload-moments would fit" in str(refused.value)  # rules out
    assert str(refused.value).endswith("--no-offload-moments rules it out")
    with pytest.raises(ValueError, match=r"longest that fits is .* --offload-moments"):
        planner.plan_run(replace(auto, seq_len=16384), ONE_H100)
    # a host of 2 TiB fits all the model state, AdamW then on its cores: 09 is faster, taken
    roomy = planner.plan_run(auto, replace(ONE_H100, host_mem=2**41))
    assert roomy.chosen.cfg.offload_moments
    on_host = planner.plan_run(replace(auto, overlap_optimizer=False),
                               replace(ONE_H100, host_mem=2**41))
    assert on_host.chosen.cfg.offload_model_state
    assert on_host.lines[1].endswith("--no-overlap-optimizer rules it out")
    # a host of unknown size takes nothing the planner would add there: no 09
    with pytest.raises(ValueError, match="nothing fits"):
        planner.plan_run(auto, replace(ONE_H100, host_mem=None))
    # where a plan with the state on the GPU fits, 09 where predicted faster (the test above)
    assert planner.plan_run(replace(auto, seq_len=32768), ONE_H200).chosen.cfg.offload_moments


@pytest.mark.parametrize("seq_len, shown", [(65536, False), (16384, True)])
def test_the_copies_show_where_a_block_s_forward_is_shorter(seq_len, shown):
    """One block's moments (1.62 GiB) take ~40 ms each way at 44 GB/s (both ways at once,
    beside a step's kernels): at 64K a block's forward (~100 ms) hides them but for block 0's
    copy in; at 16K (~14 ms) each block's forward waits the difference."""
    cfg = replace(PLANNED, seq_len=seq_len, offload_moments=True)
    rates = step_time.rates_for("NVIDIA H200")
    seconds = step_time.step_seconds(cfg, 1, rates, "fa4")["moment copies (09)"]
    block = byte_counts.streamed_moment_bytes(llama.get_model_args("llama3-8b"), 1)["block"]
    copy = block / (rates.pinned_copy * step_time.BOTH_WAYS)  # (the other way runs too)
    assert seconds > 10 * copy if shown else seconds == pytest.approx(copy)
    assert step_time.step_seconds(PLANNED, 1, rates, "fa4")["moment copies (09)"] == 0
