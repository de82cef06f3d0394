"""03_checkpoint_offload.py: checkpointing and offload change no number, the offload really moves
the block inputs to the host and back in time, and repeated steps reuse the same buffers."""

import contextlib
import gc
import importlib
import os
import subprocess
import sys
import warnings
import weakref
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from ranks import run_ranks
from reference import (GPU_KERNELS, TINY_4L, assert_matches, assert_step_matches,
                       assert_tensors_do_not_accumulate, build_as_train, full, live_tensors,
                       make_batch, reference_loss_and_grads, settled_memory_allocated,
                       train_loss_and_grads, with_kernel)

import plan
from base import host_buffers, kernels
import model as llama
from support.data import TokenData
from support.demos import bytes_saved_for_backward
from support import byte_counts
import plan as planner
from support.config import Config, resolve_techniques
from support.runtime import Machine

checkpointing = importlib.import_module("03_checkpoint_offload")
ulysses = importlib.import_module("02_ulysses")
train = importlib.import_module("train")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 4 layers: 3 offloaded block inputs, so prefetching has a chain to follow.
MODEL = TINY_4L
ARGS = llama.get_model_args(MODEL)
L = ARGS.n_layers
ROWS, SEQ = 2, 32


def _check_offload_stats(stats, local_tokens, itemsize=4, checkpointed=L):
    """One step moved the first `checkpointed` blocks' inputs but the last of them to the host
    and brought each back, prefetched, before its block's backward used it; the last
    checkpointed block's input stayed, and no other block's was touched."""
    k = checkpointed
    block_input = ROWS * local_tokens * ARGS.dim * itemsize
    assert stats["offloaded"] == k - 1 and stats["offloaded_bytes"] == (k - 1) * block_input, stats
    assert stats["restored"] == k - 1 and stats["restored_bytes"] == (k - 1) * block_input, stats
    assert stats["kept"] == 1 and stats["kept_bytes"] == block_input, stats
    assert stats["prefetched"] == k - 1, stats
    # block inputs' (not --keep-attention's)
    events = [e for e in stats["events"] if "attention" not in e]
    assert events[:k] == [f"offload {i}" for i in range(k - 1)] + [f"keep {k - 1}"], events
    assert all(int(e.split()[-1]) < k for e in stats["events"]), events  # the others: untouched
    uses = [e for e in events if e.startswith("use")]
    assert uses == [f"use {i}" for i in reversed(range(k))], events  # backward order, once each
    for i in range(k - 1):
        # Block i's input started coming back just before block i+1's backward (so the copy
        # overlaps it), and before block i used it.
        assert events.index(f"prefetch {i}") == events.index(f"use {i + 1}") - 1, events
        assert events.index(f"prefetch {i}") < events.index(f"use {i}"), events
    every = stats["events"]  # --keep-attention's kept outputs too: each back before its use
    for i in range(k - 1):
        if f"use attention {i}" in every:
            assert every.index(f"prefetch attention {i}") < every.index(f"use attention {i}")
    assert not any(e.startswith("fetch") for e in every), every  # nothing fetched late


def _equal_with_and_without_checkpoint_and_offload():
    sp = dist.get_world_size()
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=3, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads(MODEL, tokens, labels)
    results = {}
    for checkpointing, offloading in [(False, False), (True, False), (True, True)]:
        cfg = Config(model=MODEL, fsdp=True, ulysses=True, checkpoint=checkpointing,
                     offload=offloading, seq_len=SEQ, batch_size=ROWS)
        loss, grads = train_loss_and_grads(cfg, tokens, labels)
        what = f"checkpoint={checkpointing} offload={offloading} sp={sp}"
        assert_matches(loss, grads, ref_loss, ref_grads, what=what)
        results[what] = (loss, grads)
    # --checkpoint-layers k < L: checkpointed alone, and offloaded with --keep-attention.
    for k, offloading in [(k, offloading) for k in range(1, L) for offloading in (False, True)]:
        cfg = Config(model=MODEL, fsdp=True, ulysses=True, checkpoint=True,
                     offload=offloading, keep_attention=offloading, checkpoint_layers=k,
                     seq_len=SEQ, batch_size=ROWS)
        model, rt, _ = build_as_train(cfg)
        with forward_kernel_calls() as calls:
            loss = train.forward_backward(model, tokens, rt, labels)
        if offloading:  # kept: the k blocks' kernel ran in their forward, not in the recompute
            assert len(calls) == k, (k, len(calls))
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        what = f"checkpoint_layers={k} offload={offloading} keep_attention={offloading} sp={sp}"
        assert_matches(loss, grads, ref_loss, ref_grads, what=what)
        if not offloading:  # (--keep-attention's kernels are others than plain attention's)
            results[what] = (loss, grads)
            continue
        # Both act on the first k blocks only: k - 1 inputs moved, block k - 1's kept on the
        # device as the last, k attention outputs kept; the other blocks untouched.
        _check_offload_stats(model.checkpoint_offload.stats, SEQ // sp, checkpointed=k)
        kept = model.kept_attention.stats
        planned = sum(byte_counts.kept_attention_bytes(ARGS, ROWS * SEQ, sp, 4))
        assert kept["kept"] == kept["taken"] == k and kept["kept_bytes"] == k * planned, kept
        assert kept["offloaded_bytes"] == kept["restored_bytes"] == (k - 1) * planned, kept
        assert not model.checkpoint_offload.waiting and not model.kept_attention.waiting
    # Recompute and the host round trip reproduce the same bits on the CPU.
    (loss0, grads0), *others = results.values()
    for loss, grads in others:
        assert torch.equal(loss, loss0)
        assert all(torch.equal(grads[name], grads0[name]) for name in grads0)

    # The offload acts: count what moved during one step of the same configuration.
    model, rt, _ = build_as_train(Config(model=MODEL, fsdp=True, ulysses=True, offload=True,
                                 seq_len=SEQ, batch_size=ROWS))
    offloader = model.checkpoint_offload
    train.forward_backward(model, tokens, rt, labels)
    _check_offload_stats(offloader.stats, SEQ // sp)
    # one buffer per block input
    assert offloader.host_buffers.nbytes == offloader.stats["offloaded_bytes"]
    assert not offloader.waiting


def test_loss_and_grads_equal_reference_with_fsdp_ulysses_checkpoint_offload():
    """P=2 (FSDP + Ulysses): none / checkpoint / checkpoint+offload, and the first k < L blocks
    checkpointed (alone; offloaded with --keep-attention), all equal the unsharded fp32 model
    (without --keep-attention each other bit for bit); the offload moved the k-1 inputs of the
    blocks it offloads out and back."""
    run_ranks(2, _equal_with_and_without_checkpoint_and_offload)



@contextlib.contextmanager
def forward_kernel_calls():
    """Within: every call of the attention forward kernel (kernels.attention_forward_lse)
    appends to the list yielded."""
    forward_lse, calls = kernels.attention_forward_lse, []
    kernels.attention_forward_lse = lambda *a, **kw: (calls.append(1), forward_lse(*a, **kw))[1]
    try:
        yield calls
    finally:
        kernels.attention_forward_lse = forward_lse


def _kept_waiting(model) -> dict:
    """--keep-attention's kept tensors not yet taken back ({} without it)."""
    return model.kept_attention.waiting if model.kept_attention is not None else {}


def _repeated_steps_do_not_grow(keep_attention: bool):
    sp = dist.get_world_size()
    model, rt, cfg = build_as_train(Config(model=MODEL, fsdp=True, ulysses=True, offload=True,
                                   keep_attention=keep_attention, seq_len=SEQ,
                                   batch_size=ROWS, lr=1e-3))
    offloader = model.checkpoint_offload
    optimizer = train.make_optimizer(model, cfg)
    data = TokenData(cfg, ARGS.vocab_size, rt.dp_rank, rt.dp)
    # --keep-attention: each block's output and log-sum-exp have host buffers of their own
    kept = byte_counts.kept_attention_bytes(ARGS, ROWS * SEQ, sp, 4) if keep_attention else []
    live, buffers = [], []
    for step in range(5):
        train.train_step(model, optimizer, data.batch(step), rt, cfg)
        _check_offload_stats(offloader.stats, SEQ // sp)
        assert not offloader.waiting and not _kept_waiting(model)  # all came back, let go
        host = offloader.host_buffers
        assert host.allocations == (L - 1) * (1 + len(kept)), host.allocations
        assert host.nbytes == (L - 1) * (ROWS * SEQ // sp * ARGS.dim * 4 + sum(kept))
        buffers.append({pool: [p.data_ptr() for b in free for p in b.pieces]
                        for pool, free in host.free.items()})
        live.append(live_tensors())
    assert all(b == buffers[0] for b in buffers), buffers  # the same host memory every step
    # Step 0 creates the optimizer state; after it, nothing accumulates (no copies brought back
    # and kept, no handles, no host buffers).
    assert_tensors_do_not_accumulate(live)


def _repeated_steps_with_and_without_keep_attention():
    for keep_attention in (False, True):
        _repeated_steps_do_not_grow(keep_attention)


@pytest.mark.slow
def test_repeated_steps_reuse_host_buffers_and_leak_nothing():
    """Five steps with and without --keep-attention: the same host buffers every step, nothing
    left waiting, no tensor more."""
    run_ranks(2, _repeated_steps_with_and_without_keep_attention)


def _keep_attention_changes_no_number_and_skips_the_recompute_kernel():
    sp = dist.get_world_size()
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=3, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads(MODEL, tokens, labels)
    for seam, offloading in [(s, o) for s in ("ulysses", "untied") for o in (False, True)]:
        results = {}
        for keep in (False, True):
            cfg = Config(model=MODEL, fsdp=True, checkpoint=True, offload=offloading,
                         keep_attention=keep, seq_len=SEQ, batch_size=ROWS,
                         **{seam: True})
            model, rt, cfg = build_as_train(cfg)
            with forward_kernel_calls() as calls:
                train.forward_backward(model, tokens, rt, labels)
            step_calls = len(calls)
            loss, grads = train_loss_and_grads(cfg, tokens, labels)
            what = f"{seam} offload={offloading} keep_attention={keep} sp={sp}"
            assert_matches(loss, grads, ref_loss, ref_grads, what=what)
            results[keep] = (loss, grads, step_calls)
            if not keep:
                continue
            # The technique acts: the forward kernel ran once per block (05: per stage),
            # never in the recompute, which took each block's kept output back.
            stages = ARGS.n_heads // sp if seam == "untied" else 1  # train.py's U = P here
            assert step_calls == L * stages, (what, step_calls)
            kept = model.kept_attention.stats
            assert kept["kept"] == kept["taken"] == L, (what, kept)
            planned = sum(byte_counts.kept_attention_bytes(ARGS, ROWS * SEQ, sp, 4))
            assert kept["kept_bytes"] == L * planned, (what, kept, planned)
            if offloading:  # moved like the block inputs: out, and back one block ahead
                assert (kept["offloaded_bytes"] == kept["restored_bytes"]
                        == (L - 1) * planned), (what, kept)
                events = model.checkpoint_offload.stats["events"]
                assert f"keep attention {L - 1}" in events, events
                for i in range(L - 1):
                    assert (events.index(f"prefetch attention {i}")
                            < events.index(f"use {i + 1}")
                            < events.index(f"use attention {i}")), events
                assert not any(e.startswith("fetch") for e in events), events
                assert not model.kept_attention.waiting  # all taken back
        # The same kernels on the CPU, called once instead of twice: the same bits.
        (loss0, grads0, _), (loss1, grads1, _) = results[False], results[True]
        assert torch.equal(loss0, loss1), (seam, offloading)
        assert all(torch.equal(grads0[n], grads1[n]) for n in grads0), (seam, offloading)
        # Without it 05 runs every stage's forward twice (forward, recompute).
        if seam == "untied":
            assert results[False][2] == 2 * results[True][2], results


def _keep_attention_skips_the_recompute_kernel_one_rank():
    model, rt, _ = build_as_train(Config(model=MODEL, fsdp=True, checkpoint=True, untied=True,
                                         keep_attention=True, seq_len=SEQ, batch_size=ROWS))
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=3)
    with forward_kernel_calls() as calls:
        train.forward_backward(model, tokens, rt, labels)
    kept = model.kept_attention.stats
    assert kept["kept"] == kept["taken"] == L, kept
    assert len(calls) == L * ARGS.n_heads, calls  # 05's U = P = 1: a stage per head, once


def test_keep_attention_skips_the_recompute_kernel_on_one_rank():
    """The quick loop's check that --keep-attention acts (05's stages, one rank): each block's
    stages run their forward kernel once, and the recompute takes the kept output back."""
    run_ranks(1, _keep_attention_skips_the_recompute_kernel_one_rank)


@pytest.mark.slow
def test_keep_attention_changes_no_number_and_skips_the_recompute_kernel():
    """--keep-attention under 02 and 05 (P=2, FSDP), with and without offload: the unsharded
    model's loss and gradients; the attention forward runs once per block and the recompute
    takes the kept output instead; offloaded, the kept tensors go out and come back one block
    ahead, as many bytes as the planner counts."""
    run_ranks(2, _keep_attention_changes_no_number_and_skips_the_recompute_kernel)


def test_host_memory_is_checked_before_a_gpu_run_builds_anything():
    """Offloading at 1M tokens on 2 GPUs of a 251 GiB host: the checkpoints fit (2 x 124.0 GiB),
    with --keep-attention they do not (2 x 249.9): refused with the numbers and what to drop,
    where the kernel would otherwise kill a rank mid-step."""
    GiB = 2**30
    cfg = resolve_techniques(Config(model="llama3-8b", seq_len=2**20, stack=5,
                                    device="cpu", dtype="bfloat16"))
    assert plan.host_memory_error(cfg, 2, 2, 251 * GiB) is None
    assert "248.0 GiB" in plan.host_memory_error(cfg, 2, 2, 200 * GiB)
    kept = replace(cfg, keep_attention=True)
    error = plan.host_memory_error(kept, 2, 2, 251 * GiB)
    assert "499.9 GiB" in error and "251.0 GiB available" in error and "--keep-attention" in error
    nothing_offloaded = replace(cfg, offload=False)
    assert plan.host_memory_error(nothing_offloaded, 2, 2, 1) is None
    assert plan.host_memory_error(kept, 2, 2, None) is None  # unknown: not refused


@pytest.mark.parametrize("keep_attention", [False, True])
def test_a_forward_whose_backward_never_ran_leaves_nothing_behind(keep_attention):
    """A forward with gradients and no backward (an error between them, say) leaves offloaded
    inputs and kept outputs behind; the next step hands their host buffers back to the pool
    instead of pinning new ones, and ends with nothing waiting."""
    model, rt, _ = build_as_train(Config(model=MODEL, offload=True, keep_attention=keep_attention,
                                 seq_len=SEQ, batch_size=ROWS))
    offloader = model.checkpoint_offload
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=4)
    train.forward_backward(model, tokens, rt, labels)
    host = offloader.host_buffers
    allocations, host_bytes = host.allocations, host.nbytes
    input_ids, step_labels, positions = ulysses.shard_sequence(tokens, 0, 1, labels)
    model(input_ids, positions, step_labels)  # its backward never runs
    assert offloader.waiting and bool(_kept_waiting(model)) == keep_attention
    train.forward_backward(model, tokens, rt, labels)
    assert (host.allocations, host.nbytes) == (allocations, host_bytes)
    assert not offloader.waiting and not _kept_waiting(model)


def test_a_run_refused_for_host_memory_leaves_the_earlier_run_alone(tmp_path, monkeypatch):
    """The host check runs before the outputs are claimed: with --overwrite a refused run must
    not already have deleted the earlier run's checkpoints or emptied its log."""
    run = ["--steps", "1", "--save-dir", str(tmp_path / "ckpt"),
           "--log-file", str(tmp_path / "log")]
    train.train(train.parse_args(run))
    before = sorted(os.listdir(tmp_path / "ckpt")), (tmp_path / "log").read_text()

    def refuse(cfg, machine):
        raise ValueError("the host memory planned ... is more than the ... available")

    # A GPU run's machine, and its planner refusing it there, where it checks host memory.
    monkeypatch.setattr(train, "read_machine", lambda cfg: Machine(1, None, 80 * 2**30, None, 1))
    monkeypatch.setattr(plan, "plan_run", refuse)
    with pytest.raises(ValueError, match="host memory"):
        train.train(train.parse_args(run + ["--overwrite"]))
    assert (sorted(os.listdir(tmp_path / "ckpt")), (tmp_path / "log").read_text()) == before
    assert any(name.startswith("step_") for name in before[0]) and before[1]


def test_offload_acts_on_memory_kept_for_backward():
    """One process: the bytes kept from forward to backward drop by the block activations with
    checkpointing, and by L-1 more block inputs with offload (which the host holds instead)."""
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=1)
    kept, host = {}, {}
    for mode, (checkpoints, offloading) in checkpointing.MODES.items():
        model, rt, _ = build_as_train(Config(model=MODEL, checkpoint=checkpoints,
                                     offload=offloading, seq_len=SEQ, batch_size=ROWS))
        offloader = model.checkpoint_offload if checkpoints else None
        kept[mode] = bytes_saved_for_backward(
            lambda: train.forward_backward(model, tokens, rt, labels), offloader)
        host[mode] = offloader.host_buffers.nbytes if offloader else 0
    block_input = ROWS * SEQ * ARGS.dim * 4
    assert kept["checkpoint"] - kept["offload"] == (L - 1) * block_input, kept
    assert host["offload"] == (L - 1) * block_input and host["checkpoint"] == 0
    # A block saves many times its input for backward; checkpointing keeps only the input.
    assert kept["none"] - kept["checkpoint"] > 5 * L * block_input, kept
    planned = byte_counts.checkpoint_memory_bytes(ARGS, SEQ, 1, offload=True, bytes_per_value=4)
    assert planned == {"gpu": block_input // ROWS, "host": (L - 1) * block_input // ROWS}


def test_checkpointing_k_blocks_keeps_k_inputs_and_the_others_activations():
    """--checkpoint-layers acts: each block checkpointed keeps its input instead of its
    activations, so the bytes kept for backward fall as k grows, block by block by what the
    planner counts (fp32, norms op by op as on the CPU); offloaded, k - 1 inputs go to the
    host. Were `layers` ignored, every k would keep what k = L keeps."""
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=1)
    block_input = ROWS * SEQ * ARGS.dim * 4
    kept, moments = {}, {}
    for k, offloading in [(k, o) for k in range(L + 1) for o in (False, True) if k or not o]:
        cfg = Config(model=MODEL, checkpoint=k > 0, offload=offloading,
                     checkpoint_layers=k or None, seq_len=SEQ, batch_size=ROWS)
        model, rt, cfg = build_as_train(cfg)
        offloader = model.checkpoint_offload if k else None
        kept[k, offloading] = bytes_saved_for_backward(
            lambda: train.forward_backward(model, tokens, rt, labels), offloader)
        if offloading:
            assert offloader.host_buffers.nbytes == (k - 1) * block_input
            assert kept[k, True] == kept[k, False] - (k - 1) * block_input, kept
        else:
            end_of_forward = planner.plan_memory(cfg, 1, fused_norm=False)["moments"][
                "end of forward (loss)"]
            moments[k] = end_of_forward["saved"] + end_of_forward["attention"]
    steps = [kept[k, False] - kept[k + 1, False] for k in range(L)]
    assert all(step > 5 * block_input for step in steps), steps
    # Exactly the planner's step while any block keeps its activations (those blocks also
    # share the rotary tables, which checkpointed blocks hold outside autograd's saved tensors).
    assert steps[:-1] == [moments[k] - moments[k + 1] for k in range(L - 1)], (steps, moments)


@pytest.mark.parametrize("techniques", [{}, {"untied": True, "head_chunk": 2},
                                        {"tile_mlp": True, "tile_norm": True, "tile_loss": True}])
def test_unchecked_blocks_release_their_norm_outputs_and_compute_them_again(techniques,
                                                                         monkeypatch):
    """recompute_norms acts: with the first block checkpointed, each of the other L - 1 keeps
    two token-sized tensors fewer from forward to backward (its norms' outputs, fp32 here), and
    computes them again bit for bit: the same loss and gradients as when they are kept; also
    under 04's tiled norms and MLP and 05's stages, which read them in their own ways."""
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=4)
    cfg = Config(model=MODEL, checkpoint=True, checkpoint_layers=1, seq_len=SEQ,
                 batch_size=ROWS, **techniques)
    kept, grads = {}, {}
    for released in (True, False):
        if not released:
            monkeypatch.setattr(checkpointing, "recompute_norms", lambda block: None)
        model, rt, _ = build_as_train(cfg)
        kept[released] = bytes_saved_for_backward(
            lambda: train.forward_backward(model, tokens, rt, labels))
        grads[released] = {n: p.grad for n, p in model.named_parameters()}
    hidden = ROWS * SEQ * ARGS.dim * 4
    assert kept[False] - kept[True] == (L - 1) * 2 * hidden, kept
    assert all(torch.equal(grads[True][n], grads[False][n]) for n in grads[False])


def test_a_recomputed_norm_output_goes_with_its_readers_backward(monkeypatch):
    """A norm output computed again lives only through its reader's backward, as a kept one
    does: once backward has left the unchecked blocks (at checkpointed block 0's output), none
    of their norm outputs is alive. (The hook that computes it again lives with the graph
    until the whole backward is done; holding the output there kept all of them, 4 x tokens x
    dim per block.)"""
    outputs, alive_below = [], []
    release = checkpointing.release_norm_output

    def watched(norm, latest, reader, inputs, output):
        if "output" in latest:
            outputs.append(StorageWeakRef(latest["output"].untyped_storage()))
        return release(norm, latest, reader, inputs, output)

    monkeypatch.setattr(checkpointing, "release_norm_output", watched)
    model, rt, _ = build_as_train(Config(model=MODEL, checkpoint=True, checkpoint_layers=1,
                                         seq_len=SEQ, batch_size=ROWS))

    def at_block_0(block, inputs, output):
        if output.requires_grad:
            output.register_hook(lambda grad: alive_below.append(
                [not ref.expired() for ref in outputs]))

    model.layers[0].register_forward_hook(at_block_0)
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=6)
    train.forward_backward(model, tokens, rt, labels)
    assert len(outputs) == 2 * (L - 1) and alive_below == [[False] * len(outputs)], alive_below


def test_released_norm_outputs_leave_nothing_behind_from_step_to_step():
    """Five steps with 1 of 4 blocks checkpointed: recompute_norms' hooks on each step's
    tensors go with that step's graph (no tensor more after the first step, which makes
    AdamW's state)."""
    model, rt, cfg = build_as_train(Config(model=MODEL, checkpoint=True, checkpoint_layers=1,
                                   seq_len=SEQ, batch_size=ROWS, lr=1e-3))
    optimizer = train.make_optimizer(model, cfg)
    data = TokenData(cfg, ARGS.vocab_size, rt.dp_rank, rt.dp)
    live = []
    for step in range(5):
        train.train_step(model, optimizer, data.batch(step), rt, cfg)
        live.append(live_tensors())
    assert_tensors_do_not_accumulate(live)


def test_offloaded_inputs_are_really_released():
    """Copying a block input to the host frees nothing while anything still references the
    original: after forward, every offloaded input must be gone (only the last block's stays),
    which is what lets the GPU reuse that memory. (A strong reference from the pack hook once
    kept them all alive on the GPU although the copies were made and counted.)"""
    model, rt, _ = build_as_train(Config(model=MODEL, offload=True, seq_len=SEQ, batch_size=ROWS))
    offloader = model.checkpoint_offload
    seen, pack = [], offloader.pack

    def watching_pack(layer, x_ref, t):
        if t.numel():
            seen.append((layer, weakref.ref(t)))
        return pack(layer, x_ref, t)

    offloader.pack = watching_pack
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=2)
    input_ids, labels, positions = ulysses.shard_sequence(tokens, 0, 1, labels)
    loss = model(input_ids, positions, labels)
    gc.collect()
    alive = {layer: ref() is not None for layer, ref in seen}
    assert alive == {layer: layer == L - 1 for layer in range(L)}, alive
    loss.backward()


def test_inputs_fetched_late_are_counted_as_fetched_not_prefetched():
    """With the prefetch chain broken (no prefetch ever starts), every offloaded input comes
    back through a "fetch" at its own unpack: the step is the same bits as with prefetching,
    and the record says so (prefetched 0), rather than crediting a prefetch that never ran."""
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=2)
    results = {}
    for prefetching in (True, False):
        model, rt, _ = build_as_train(Config(model=MODEL, offload=True, seq_len=SEQ,
                                             batch_size=ROWS))
        offloader = model.checkpoint_offload
        if not prefetching:
            bring_back = offloader.bring_back
            offloader.bring_back = lambda layer, event: (
                None if event == "prefetch" else bring_back(layer, event))
        loss = train.forward_backward(model, tokens, rt, labels)
        results[prefetching] = (loss, {n: p.grad for n, p in model.named_parameters()})
    stats = offloader.stats
    assert stats["restored"] == L - 1 and stats["prefetched"] == 0, stats
    assert [e for e in stats["events"] if e.startswith("fetch")] == [
        f"fetch {i}" for i in reversed(range(L - 1))], stats
    (loss0, grads0), (loss1, grads1) = results[True], results[False]
    assert torch.equal(loss0, loss1)
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)


def test_a_brought_back_input_is_released_with_its_block_even_under_retain_graph():
    """The offloader hands each input back once and keeps no reference to it: even when the
    graph is retained, block i's input is gone by the time block i-1's is unpacked, and a
    second backward is refused with the offloader's own message (not served from copies the
    offloader kept alive on the device)."""
    model, rt, _ = build_as_train(Config(model=MODEL, offload=True, seq_len=SEQ, batch_size=ROWS))
    offloader = model.checkpoint_offload
    handed, alive_at_unpack, unpack = [], [], offloader.unpack

    def watching_unpack(held):
        x = unpack(held)
        if not isinstance(held, torch.Tensor):
            alive_at_unpack.append([ref() is not None for ref in handed])
            handed.append(weakref.ref(x))
        return x

    offloader.unpack = watching_unpack
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=2)
    input_ids, labels, positions = ulysses.shard_sequence(tokens, 0, 1, labels)
    loss = model(input_ids, positions, labels)
    loss.backward(retain_graph=True)
    gc.collect()
    assert alive_at_unpack == [[False] * i for i in range(L)], alive_at_unpack
    assert not any(ref() is not None for ref in handed)
    with pytest.raises(RuntimeError, match="offloaded input was already used"):
        loss.backward()


def test_no_grad_forward_saves_nothing_and_matches():
    model, rt, _ = build_as_train(Config(model=MODEL, offload=True, seq_len=SEQ))
    plain, _, _ = build_as_train(Config(model=MODEL, seq_len=SEQ))
    ids = torch.randint(0, ARGS.vocab_size, (1, SEQ))
    positions = torch.arange(SEQ)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions), plain(ids, positions), rtol=0, atol=0)
    assert model.checkpoint_offload.stats["events"] == []


def test_parameter_names_unchanged_and_applied_once():
    with torch.device("meta"):
        model = llama.Transformer(ARGS)
    names = [n for n, _ in model.named_parameters()]
    checkpointing.apply_checkpointing(model, offload=True)
    assert [n for n, _ in model.named_parameters()] == names
    with pytest.raises(ValueError, match="already applied"):
        checkpointing.apply_checkpointing(model)


def test_planner_bytes_llama3_8b_3m_tokens_8_gpus():
    args = llama.get_model_args("llama3-8b")
    seq_len = 3 * 2**20
    plain = byte_counts.checkpoint_memory_bytes(args, seq_len, 8, offload=False)
    moved = byte_counts.checkpoint_memory_bytes(args, seq_len, 8, offload=True)
    assert plain == {"gpu": 96 * 2**30, "host": 0}  # 32 layers x 3 GiB
    assert moved == {"gpu": 3 * 2**30, "host": 93 * 2**30}  # the data
    pinned = byte_counts.checkpoint_memory_bytes(args, seq_len, 8, offload=True, pinned=True)
    assert pinned == moved  # power-of-two pieces: the pinned allocator rounds nothing up
    # the sequence-split rule lives once, in 02, and the planner checks it before counting
    with pytest.raises(ValueError, match=r"sequence length \(3145728\) must be divisible .*\(7\)"):
        importlib.import_module("02_ulysses").check_sequence_split(seq_len, 7)


def test_host_buffers_are_power_of_two_pieces_that_round_trip():
    """The pinned allocator rounds every request up to a power of two (a 3 GiB buffer takes 4);
    the offloader asks for the binary digits of the size instead, each reserved exactly."""
    GiB, MiB = 2**30, 2**20
    assert host_buffers.power_of_two_pieces(3 * GiB) == [2 * GiB, GiB]
    assert host_buffers.power_of_two_pieces(int(1.5 * GiB)) == [GiB, GiB // 2]
    assert host_buffers.power_of_two_pieces(10 * GiB + 3 * MiB) == [8 * GiB, 2 * GiB, 2 * MiB, MiB]
    # the rest rounded up
    assert host_buffers.power_of_two_pieces(3 * MiB + 5) == [2 * MiB, 2 * MiB]
    assert host_buffers.power_of_two_pieces(1000) == [1024]
    x = torch.randn(3, 1000, 250)  # 3,000,000 bytes: 2 MiB + the rest in a 1 MiB piece
    buffer = host_buffers.HostBuffer(x.shape, x.dtype, pinned=x.is_cuda)
    assert [p.numel() for p in buffer.pieces] == [2 * MiB, MiB] and buffer.holds(x)
    back = torch.empty_like(x)
    buffer.copy_from(x)
    buffer.copy_into(back)
    assert torch.equal(back, x)
    # the pool: a buffer given back is taken again for the same shape; for another shape
    # (a shorter last micro-batch, a new length) it is let go, and the pool counts only the new
    pool = host_buffers.HostBufferPool()
    first = pool.take("block 1", x)
    pool.give_back("block 1", first)
    assert pool.take("block 1", x) is first and pool.nbytes == x.nbytes
    pool.give_back("block 1", first)
    y = torch.randn(2, 1000, 250)
    second = pool.take("block 1", y)
    assert second is not first and pool.nbytes == y.nbytes and pool.allocations == 2


@pytest.mark.slow
def test_train_py_stack_3_runs():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # (the first of tiny's 2 blocks checkpointed, --checkpoint-layers' path end to end)
    result = subprocess.run([sys.executable, "train.py", "--stack", "3", "--steps", "3",
                             "--checkpoint-layers", "1"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    # the run log names the techniques it applied
    assert "checkpoint (first 1 of 2 layers), offload" in result.stdout, result.stdout


# ---------------------------------------------------------------------------------------------
# On a GPU: pinned host memory, the side stream, lower memory, same numbers.
# ---------------------------------------------------------------------------------------------

def _gpu_offload_is_pinned_async_and_exact():
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=5)
    ref_loss, ref_grads = reference_loss_and_grads(MODEL, tokens, labels)
    base = dict(model=MODEL, fsdp=True, ulysses=True, seq_len=SEQ, batch_size=ROWS,
                device="cuda", dtype="float32")
    for offloading in (False, True):
        cfg = Config(checkpoint=True, offload=offloading, **base)
        loss, grads = train_loss_and_grads(cfg, tokens, labels)
        # fp32 on the GPU, as tight as on the CPU: nothing here enables TF32.
        assert_matches(loss.cpu(), {n: g.cpu() for n, g in grads.items()}, ref_loss, ref_grads,
                       what=f"cuda fp32 offload={offloading}")

    model, rt, cfg = build_as_train(Config(offload=True, **base))
    offloader = model.checkpoint_offload
    optimizer = train.make_optimizer(model, cfg)
    after_step = []
    for step in range(3):
        train.train_step(model, optimizer, tokens, rt, cfg)
        _check_offload_stats(offloader.stats, SEQ)
        after_step.append(settled_memory_allocated())
    buffers = [b for free in offloader.host_buffers.free.values() for b in free]
    assert len(buffers) == L - 1
    assert all(p.is_pinned() and p.device.type == "cpu" for b in buffers for p in b.pieces)
    assert offloader.stream is not None
    assert offloader.stream.cuda_stream != torch.cuda.current_stream().cuda_stream  # a side stream
    assert offloader.host_buffers.allocations == L - 1
    # Nothing left behind on the GPU: memory does not grow from step to step. (On an H200,
    # torch 2.11, a later step can end lower than the first by up to two fp32 copies of the
    # parameters: [70571008, 70571008, 69878272] with AdamW foreach=False (one copy of tiny-4L's
    # 172,608 parameters x 4, in 512-byte blocks), [71281664, 71281664, 69898240] with the fused
    # AdamW (two): something of FSDP's or AdamW's let go, not the offload.)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after_step[2] <= after_step[1] <= after_step[0], after_step
    assert after_step[0] - after_step[2] <= 2 * params + 4096, (after_step, params)


def _gpu_memory_after_forward_and_syncs(offloading: bool, args, seq_len: int):
    """GPU bytes held between forward and backward, and how many times forward + backward made
    the host wait for the GPU (torch's sync debug mode)."""
    llama.PRESETS["small-8L"] = args
    model, rt, _ = build_as_train(Config(model="small-8L", checkpoint=True, offload=offloading,
                                 seq_len=seq_len, device="cuda", dtype="float32"))
    ids = torch.randint(0, args.vocab_size, (1, seq_len), device="cuda")
    positions = torch.arange(seq_len, device="cuda")[None]
    model(ids, positions, ids).backward()  # warm-up: first-call allocations and plans
    model.zero_grad(set_to_none=True)
    before = settled_memory_allocated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = model(ids, positions, ids)
            torch.cuda.set_sync_debug_mode(0)
            between = settled_memory_allocated() - before
            torch.cuda.set_sync_debug_mode("warn")
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return between, syncs


@pytest.mark.gpu
def test_gpu_unchecked_blocks_release_their_norm_outputs(monkeypatch):
    """On a GPU (bf16, F.rms_norm's fused kernel, FSDP on one rank): with 1 of 8 blocks
    checkpointed, the GPU holds 7 x 2 norm outputs fewer between forward and backward, as
    support/byte_counts.py counts them, and the gradients are the same bits."""
    run_ranks(1, _gpu_norm_outputs_released, backend="nccl")


def _gpu_norm_outputs_released():
    args = replace(llama.get_model_args("small"), n_layers=8)
    llama.PRESETS["small-8L"] = args
    seq_len = 4096
    # the math attention kernel: deterministic, so the two gradients can be the same bits
    # (FlashAttention-4's backward sums in no fixed order: 0.6% apart at layer 0 on an H100)
    cfg = Config(model="small-8L", fsdp=True, checkpoint=True, checkpoint_layers=1,
                 seq_len=seq_len, device="cuda", dtype="bfloat16", attn_kernel="math")
    ids = torch.randint(0, args.vocab_size, (1, seq_len), device="cuda")
    positions = torch.arange(seq_len, device="cuda")[None]
    between, grads = {}, {}
    for released in (True, False):
        recompute = checkpointing.recompute_norms
        if not released:
            checkpointing.recompute_norms = lambda block: None
        try:
            model, rt, _ = build_as_train(cfg)
        finally:
            checkpointing.recompute_norms = recompute
        model(ids, positions, ids).backward()  # warm-up: first-call allocations and plans
        model.zero_grad(set_to_none=True)
        before = settled_memory_allocated()
        loss = model(ids, positions, ids)
        between[released] = settled_memory_allocated() - before
        loss.backward()
        grads[released] = {n: full(p.grad) for n, p in model.named_parameters()}
    planned = byte_counts.block_recompute_bytes(args, seq_len)["released"]
    # (to the allocator's 512-byte rounding of a block's small tensors: measured 512 bytes off
    # on an H100, of 58.7 MB)
    released = between[False] - between[True]
    assert abs(released - (args.n_layers - 1) * planned) <= 512 * args.n_layers, between
    differ = [n for n in grads[False] if not torch.equal(grads[True][n], grads[False][n])]
    assert not differ, differ


def _gpu_unchecked_block_matches_fp32():
    """bf16 on the GPU, 1 of 2 blocks checkpointed (the other computes its norms' outputs
    again; on one rank the reduce-scatter runs in place), against the fp32 unsharded model by
    the bf16 rule of every GPU test (reference.assert_step_matches)."""
    sp = dist.get_world_size()
    cfg = Config(model="tiny-hd64", fsdp=True, checkpoint=True, checkpoint_layers=1,
                 ulysses=sp > 1, seq_len=256, batch_size=2, device="cuda", dtype="bfloat16")
    tokens, labels = make_batch(llama.get_model_args(cfg.model).vocab_size, 2, cfg.seq_len,
                                seed=7, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads(cfg.model, tokens, labels)
    loss, grads = train_loss_and_grads(cfg, tokens, labels)
    assert_step_matches(loss.cpu(), grads, ref_loss, ref_grads, cfg.model, tokens, labels,
                        cfg.dtype, what=f"checkpoint_layers=1 sp={sp}")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_gpu_unchecked_block_bf16_matches_fp32_reference(world):
    run_ranks(world, _gpu_unchecked_block_matches_fp32, backend="nccl")


@pytest.mark.gpu
def test_gpu_offload_pinned_side_stream_less_memory_and_exact():
    run_ranks(1, _gpu_offload_is_pinned_async_and_exact, backend="nccl")
    args = replace(llama.get_model_args("small"), n_layers=8)
    seq_len = 8192
    block_input = seq_len * args.dim * 4
    kept, syncs = {}, {}
    for offloading in (False, True):
        kept[offloading], syncs[offloading] = _gpu_memory_after_forward_and_syncs(
            offloading, args, seq_len)
    # Between forward and backward the GPU no longer holds 7 of the 8 block inputs.
    assert kept[False] - kept[True] >= (args.n_layers - 1) * block_input * 0.9, kept
    # The copies never make the host wait: no synchronization beyond checkpointing's own.
    assert syncs[True] <= syncs[False], syncs
    # Pinned pieces: exact round trip on the side of a GPU, and no rounding up of the total.
    x = torch.randn(3, 1000, 250, device="cuda")  # 3,000,000 bytes: pieces of 2 MiB + 1 MiB
    stats = getattr(torch.cuda, "host_memory_stats", dict)
    before = stats().get("allocated_bytes.current")
    buffer = host_buffers.HostBuffer(x.shape, x.dtype, pinned=x.is_cuda)
    after = stats().get("allocated_bytes.current")
    assert all(p.is_pinned() for p in buffer.pieces)
    if before is not None and after is not None:  # one 3,000,000-byte request would reserve 4 MiB
        assert after - before <= 3 * 2**20, (before, after)
    back = torch.empty_like(x)
    buffer.copy_from(x, non_blocking=True)
    buffer.copy_into(back, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, x)


def _gpu_keep_attention_matches_fp32(seam: str):
    """bf16 on the GPU with --keep-attention against the fp32 unsharded model; the forward
    kernel runs once per block (05: per stage) and never in the recompute."""
    sp = dist.get_world_size()
    cfg = Config(model="tiny-hd64", fsdp=True, offload=True, keep_attention=True,
                 seq_len=256, batch_size=2, device="cuda", dtype="bfloat16",
                 attn_kernel=kernels._requested["kernel"],
                 **({"untied": True, "head_chunk": sp} if seam == "untied"
                    else {"ulysses": True}))
    args = llama.get_model_args(cfg.model)
    tokens, labels = make_batch(args.vocab_size, 2, cfg.seq_len, seed=5, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads(cfg.model, tokens, labels)
    with forward_kernel_calls() as calls:
        loss, grads = train_loss_and_grads(cfg, tokens, labels)
    assert_step_matches(loss.cpu(), grads, ref_loss, ref_grads, cfg.model, tokens, labels,
                        cfg.dtype, what=f"{seam} sp={sp}")
    stages = args.n_heads // sp if seam == "untied" else 1  # U = P
    assert len(calls) == args.n_layers * stages, calls


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("seam", ["ulysses", "untied"])
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_gpu_keep_attention_bf16_matches_fp32_reference(kernel, seam, world):
    run_ranks(world, with_kernel, kernel, _gpu_keep_attention_matches_fp32, seam, backend="nccl")
