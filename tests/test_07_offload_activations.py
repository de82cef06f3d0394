"""07: blocks that keep what they saved in host memory compute the same numbers, move exactly
what they saved (and nothing else), bring it back one block ahead, and leave nothing behind."""

import gc
import importlib
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from ranks import run_ranks
from reference import (TINY_4L, assert_matches, assert_step_matches,
                       assert_tensors_do_not_accumulate, build_as_train, full,
                       live_tensors, make_batch, reference_loss_and_grads, settled_memory_allocated,
                       train_loss_and_grads)

import model as llama
import plan as planner
from support.config import Config, resolve_techniques
from support.demos import bytes_saved_for_backward

activation_offload = importlib.import_module("07_offload_activations")
train = importlib.import_module("train")

# 4 layers: blocks below, among and above the offloaded ones.
MODEL = TINY_4L
ARGS = llama.get_model_args(MODEL)
L = ARGS.n_layers
ROWS, SEQ = 2, 32


def _check_stats(stats, first: int, count: int):
    """Every tensor sent out came back once, in backward order; each offloaded block (every
    other one from `first`) was brought back while the kept block above it ran its backward,
    never fetched late, and no other block was touched."""
    layers = range(first, first + 2 * count, 2)
    assert stats["offloaded"] == stats["restored"] == stats["prefetched"] > 0, stats
    assert stats["offloaded_bytes"] == stats["restored_bytes"], stats
    events = stats["events"]
    assert {int(e.split()[-1]) for e in events} == set(layers), events
    outs = [int(e.split()[-1]) for e in events if e.startswith("offload")]
    assert outs == sorted(outs), events  # forward order
    uses = [int(e.split()[-1]) for e in events if e.startswith("use")]
    assert uses == sorted(uses, reverse=True), events  # backward order
    assert not [e for e in events if e.startswith("fetch")], events

    def last(event):
        return len(events) - 1 - events[::-1].index(event)

    for layer in layers:
        assert events.index(f"prefetch {layer}") < events.index(f"use {layer}"), events
        # brought back one block ahead: after the offloaded block above it was used
        if layer + 2 in layers:
            assert events.index(f"prefetch {layer}") > last(f"use {layer + 2}"), events
        # its memory went once the next offloaded block's forward ran (the top's: the block
        # above it), before any other block's forward
        after = last(f"offload {layer + 2}") if layer + 2 in layers else last(f"offload {layer}")
        assert after < events.index(f"release {layer}"), events
        if layer + 4 in layers:
            assert events.index(f"release {layer}") < events.index(f"offload {layer + 4}"), events
    assert last(f"release {layers[-1]}") < events.index(f"prefetch {layers[-1]}"), events


def _equal_with_and_without_offloaded_activations():
    sp = dist.get_world_size()
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=3, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads(MODEL, tokens, labels)
    base = dict(model=MODEL, fsdp=True, ulysses=True, seq_len=SEQ, batch_size=ROWS)
    # (techniques, blocks checkpointed by 03, blocks offloaded by 07)
    cases = [({}, 0, 0), ({}, 0, 1), ({}, 0, 2),
             ({"checkpoint": True}, 1, 0), ({"checkpoint": True}, 1, 1),
             ({"offload": True, "keep_attention": True}, 2, 1),
             ({"tile_mlp": True, "tile_loss": True}, 0, 2)]
    plain = {}
    for techniques, k, count in cases:
        cfg = Config(**base, **techniques, checkpoint_layers=k or None,
                     offload_activations=count)
        model, rt, cfg = build_as_train(cfg)
        loss = train.forward_backward(model, tokens, rt, labels)
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        what = f"{techniques} checkpoint_layers={k} offload_activations={count} sp={sp}"
        assert_matches(loss, grads, ref_loss, ref_grads, what=what)
        key = (tuple(techniques), k)
        if count == 0:
            plain[key] = (loss, grads)
            continue
        stats = model.activation_offload.stats
        _check_stats(stats, k, count)
        assert not model.activation_offload.waiting
        if not techniques.get("tile_mlp"):  # exactly what the planner counts for the host
            planned = planner.plan_memory(cfg, sp, fused_norm=False)["host_parts"]
            assert stats["offloaded_bytes"] == planned["activations (07)"], (what, stats)
        if key in plain:  # the host round trip reproduces the same bits
            loss0, grads0 = plain[key]
            assert torch.equal(loss, loss0), what
            assert all(torch.equal(grads[n], grads0[n]) for n in grads0), what


def test_offloaded_activations_equal_the_reference_with_fsdp_and_ulysses():
    """P=2 (FSDP + Ulysses): 1 and 2 of 4 blocks offloaded (every other one), above 03's
    checkpointed ones (offloaded too, with keep-attention), and with 04's tiles: all equal the
    unsharded fp32 model, and bit for bit the same configuration without 07; each step moved
    every offloaded block's tensors out and back, one block ahead of its backward."""
    run_ranks(2, _equal_with_and_without_offloaded_activations)


def test_offload_moves_what_the_blocks_kept_and_the_planner_counts_it():
    """07 acts: the bytes kept for backward fall by exactly what goes to the host, block by
    block, and the host holds what the planner counts for one block (fp32, the norms op by op as
    on the CPU). Offloaded above checkpointed blocks they also move their norms' outputs, which
    03 would release: a block's host bytes are then a kept block's and those two outputs."""
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=1)
    released = 2 * ROWS * SEQ * ARGS.dim * 4  # the two norms' outputs 03 releases in a block
    kept, host = {}, {}
    for k, count in [(k, count) for k in (0, 1) for count in range((L - k) // 2 + 1)]:
        cfg = Config(model=MODEL, checkpoint=k > 0, checkpoint_layers=k or None,
                     offload_activations=count, seq_len=SEQ, batch_size=ROWS)
        model, rt, cfg = build_as_train(cfg)
        kept[k, count] = bytes_saved_for_backward(
            lambda: train.forward_backward(model, tokens, rt, labels))
        host[k, count] = model.activation_offload.host_buffers.nbytes if count else 0
        # With 03, a kept block had released its norms' outputs; offloaded it keeps them.
        gone = host[k, count] - (count * released if k else 0)
        assert kept[k, count] == kept[k, 0] - gone, (k, count, kept, host)
        planned = planner.plan_memory(cfg, 1, fused_norm=False)["host_parts"]
        assert planned["activations (07)"] == host[k, count], (k, count, planned, host)
    for k in (0, 1):  # the same bytes for each block
        counts = range((L - k) // 2 + 1)
        assert [host[k, count] for count in counts] == [count * host[k, 1] for count in counts]
    assert host[1, 1] == host[0, 1] > released, host  # the same block, sent whole either way


def test_parameters_and_shared_tables_stay_and_the_originals_go():
    """Nothing sent out is a parameter's memory or the rotary tables' (every block's), and
    what was sent out is gone from forward's memory once forward ends: only the host copy
    waits."""
    model, rt, _ = build_as_train(Config(model=MODEL, offload_activations=2, seq_len=SEQ,
                                 batch_size=ROWS))
    offloader = model.activation_offload
    sent, stayed, send, begin = [], set(), offloader.send, offloader.begin_block

    def watching_send(layer, source):
        sent.append((source.untyped_storage().data_ptr(),
                     StorageWeakRef(source.untyped_storage())))
        return send(layer, source)

    def watching_begin(layer, stays):
        begin(layer, stays=stays)
        stayed.update(offloader.stays)

    offloader.send, offloader.begin_block = watching_send, watching_begin
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=2)
    ids, positions = tokens[:, :-1], torch.arange(SEQ).expand(ROWS, SEQ)
    loss = model(ids, positions, labels)
    gc.collect()
    assert sent and stayed  # the rotary tables stayed
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not (params | stayed) & {ptr for ptr, _ in sent}
    assert all(ref.expired() for _, ref in sent), "an offloaded tensor is still in memory"
    loss.backward()
    assert offloader.stats["restored"] == offloader.stats["offloaded"] == len(sent)


class TwoViewsBlock(torch.nn.Module):
    """A block whose multiply saves two views of one buffer at different offsets, the halves of
    a fused projection (model.py's blocks save no such pair)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, 2 * dim)

    def forward(self, x, rope, cu_seqlens=None):
        a, b = self.proj(x).chunk(2, dim=-1)
        return x + a * b


def test_views_of_one_buffer_at_different_offsets_each_come_back_as_saved():
    """Each view is copied from its own byte offset, under its own key: x, and the two halves
    (overlapping spans, so each its own copy), bit for bit the gradients of the plain blocks."""
    def toy():
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList(TwoViewsBlock(8) for _ in range(2))
        return model

    torch.manual_seed(0)
    offloaded, plain = toy(), toy()
    plain.load_state_dict(offloaded.state_dict())
    activation_offload.apply_activation_offload(offloaded, 1)
    x = torch.randn(4, 8)
    for model in (offloaded, plain):
        h = x
        for block in model.layers:
            h = block(h, ())
        h.square().sum().backward()
    assert offloaded.activation_offload.stats["offloaded"] == 3, offloaded.activation_offload.stats
    for p, q in zip(offloaded.parameters(), plain.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_repeated_steps_reuse_host_buffers_and_leak_nothing():
    model, rt, _ = build_as_train(Config(model=MODEL, offload_activations=2, seq_len=SEQ,
                                         batch_size=ROWS))
    offloader = model.activation_offload
    tokens, labels = make_batch(ARGS.vocab_size, ROWS, SEQ, seed=4)
    allocations, live = [], []
    for _ in range(4):
        train.forward_backward(model, tokens, rt, labels)
        for p in model.parameters():
            p.grad = None
        allocations.append(offloader.host_buffers.allocations)
        live.append(live_tensors())
        assert not offloader.waiting and not offloader.packing
    assert allocations[1:] == allocations[:-1] and allocations[0] > 0, allocations
    assert_tensors_do_not_accumulate(live)


def test_a_forward_whose_backward_never_ran_leaves_nothing_waiting():
    model, rt, _ = build_as_train(Config(model=MODEL, offload_activations=2, seq_len=SEQ))
    offloader = model.activation_offload
    ids, positions = torch.randint(0, ARGS.vocab_size, (1, SEQ)), torch.arange(SEQ)[None]
    model(ids, positions)  # (evaluation with gradients on: its graph dropped)
    assert offloader.waiting
    buffers = offloader.host_buffers.nbytes
    loss = model(ids, positions, ids)  # the next step gives the waiting buffers back first
    loss.backward()
    assert not offloader.waiting and offloader.host_buffers.nbytes == buffers


def test_no_grad_forward_saves_nothing_and_matches():
    model, _, _ = build_as_train(Config(model=MODEL, offload_activations=L // 2, seq_len=SEQ))
    plain, _, _ = build_as_train(Config(model=MODEL, seq_len=SEQ))
    ids, positions = torch.randint(0, ARGS.vocab_size, (1, SEQ)), torch.arange(SEQ)[None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids, positions), plain(ids, positions), rtol=0, atol=0)
    assert model.activation_offload.stats["events"] == []


def test_a_second_backward_through_the_same_graph_reads_the_same_tensors():
    """retain_graph: what came back stays on the device for the second backward."""
    model, _, _ = build_as_train(Config(model=MODEL, offload_activations=2, seq_len=SEQ))
    ids, positions = torch.randint(0, ARGS.vocab_size, (1, SEQ)), torch.arange(SEQ)[None]
    loss = model(ids, positions, ids)
    loss.backward(retain_graph=True)
    once = {n: p.grad.clone() for n, p in model.named_parameters()}
    loss.backward()
    assert all(torch.equal(p.grad, 2 * once[n]) for n, p in model.named_parameters())


def test_two_forwards_before_one_backward_are_refused():
    """07 holds one forward's tensors (its host buffers are reused by the next): a backward
    through an earlier forward's graph says so instead of reading the later one's."""
    model, _, _ = build_as_train(Config(model=MODEL, offload_activations=1, seq_len=SEQ))
    ids, positions = torch.randint(0, ARGS.vocab_size, (1, SEQ)), torch.arange(SEQ)[None]
    first = model(ids, positions, ids)
    second = model(ids, positions, ids)
    with pytest.raises(RuntimeError, match="one forward's tensors at a time"):
        (first + second).backward()


def test_parameter_names_unchanged_and_applied_once():
    with torch.device("meta"):
        model = llama.Transformer(ARGS)
    names = [n for n, _ in model.named_parameters()]
    activation_offload.apply_activation_offload(model, 1, first=1)
    assert [n for n, _ in model.named_parameters()] == names
    with pytest.raises(ValueError, match="already applied"):
        activation_offload.apply_activation_offload(model, 1)


def test_offloaded_blocks_leave_their_norm_outputs_to_the_host_not_to_03():
    """Under 03 the blocks it leaves unchecked release their norms' outputs and compute them
    again (recompute_norms' hooks); the blocks 07 offloads send them to the host with the
    rest, so 07 removes those hooks there and only there."""
    model, _, _ = build_as_train(Config(model=MODEL, checkpoint=True, checkpoint_layers=1,
                                        offload_activations=1, seq_len=SEQ))
    offloaded = model.activation_offload.layers
    for layer, block in enumerate(model.layers[1:], start=1):  # 03 checkpoints block 0
        hooks = [len(m._forward_hooks) for m in (block.input_layernorm, block.self_attn,
                                                  block.post_attention_layernorm, block.mlp)]
        assert hooks == ([0] * 4 if layer in offloaded else [1] * 4), (layer, hooks)


@pytest.mark.parametrize("flags, error", [
    (dict(offload_activations=-1), "at least 0"),
    (dict(offload_activations=L // 2 + 1), "needs a kept block above it"),
    (dict(checkpoint=True, offload_activations=1), "add --checkpoint-layers K"),
    (dict(checkpoint=True, offload_activations=L // 2),  # 03 keeps one block below them
     f"the model's {L} layers allow at most {L // 2 - 1} "),
    (dict(checkpoint=True, checkpoint_layers=L - 1, offload_activations=1),
     f"2 blocks above --checkpoint-layers {L - 1}"),
])
def test_bad_offload_flags_are_refused_before_anything_runs(flags, error):
    with pytest.raises(ValueError, match=error):
        resolve_techniques(Config(model=MODEL, device="cpu", **flags))


def test_a_gpu_run_leaves_the_checkpointed_blocks_below_them_to_the_plan(monkeypatch):
    """On a GPU the plan picks --checkpoint-layers K <= L - 2N: --checkpoint with
    --offload-activations N and no K is accepted there (refused on the CPU, above, which plans
    nothing). CUDA is reported present; nothing is built."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = resolve_techniques(Config(model=MODEL, device="cuda", checkpoint=True,
                                    offload_activations=1))
    assert cfg.checkpoint_layers is None and cfg.offload_activations == 1


def test_the_planner_moves_offloaded_blocks_to_the_host():
    """Llama-3-8B at 32K on one H200: each offloaded block leaves the end of forward with all
    it kept there, the host holds that and its norms' outputs, and the checkpointed blocks that
    fit fall."""
    cfg = Config(model="llama3-8b", seq_len=32768, fsdp=True, checkpoint=True, untied=True,
                 head_chunk=32, keep_attention=True, checkpoint_layers=16, tile_loss=True,
                 dtype="bfloat16", device="cpu")
    plans = {n: planner.plan_memory(replace(cfg, offload_activations=n), 1) for n in (0, 1, 8)}
    end = {n: sum(p["moments"]["end of forward (loss)"].values()) for n, p in plans.items()}
    block = plans[1]["host_parts"]["activations (07)"]
    assert 2.5 * 2**30 < block < 3.5 * 2**30  # ~92 KiB a token, and the two norms' outputs
    assert plans[8]["host_parts"]["activations (07)"] == 8 * block
    released = 2 * 32768 * 4096 * 2  # a kept block's norms' outputs, which 03 releases
    assert end[0] - end[1] == block - released and end[0] - end[8] == 8 * (end[0] - end[1])
    gpu = 139.8 * 2**30
    fewest = {n: planner.fewest_checkpointed_layers_that_fit(
        replace(cfg, checkpoint_layers=None, offload_activations=n), 1, gpu) for n in (0, 8)}
    assert fewest[8] < fewest[0] and fewest[8] <= 32 - 2 * 8, fewest


GPU_MODEL = "tiny-hd64-4L"  # a GPU kernel's head size, 4 layers: blocks 0 and 2 offloaded
llama.PRESETS[GPU_MODEL] = replace(llama.get_model_args("tiny-hd64"), n_layers=4)


@pytest.mark.gpu
def test_gpu_offloaded_activations_bf16_match_fp32_and_free_the_gpu():
    run_ranks(1, _gpu_offloaded_matches_fp32, backend="nccl")


def _gpu_offloaded_matches_fp32():
    """bf16 on the GPU, 2 of 4 blocks offloaded (pinned buffers, side stream), against the fp32
    unsharded model by the bf16 rule of every GPU test; the memory held between forward and
    backward falls by the bytes sent to the host; and with every copy delayed, or the compute
    before each copy, the step is the same bits as without 07."""
    cfg = Config(model=GPU_MODEL, fsdp=True, offload_activations=2, seq_len=256,
                 batch_size=2, device="cuda", dtype="bfloat16")
    tokens, labels = make_batch(llama.get_model_args(cfg.model).vocab_size, 2, cfg.seq_len,
                                seed=7, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads(cfg.model, tokens, labels)
    loss, grads = train_loss_and_grads(cfg, tokens, labels)
    assert_step_matches(loss.cpu(), grads, ref_loss, ref_grads, cfg.model, tokens, labels,
                        cfg.dtype, what="offload_activations=2")
    ids, positions = tokens[:, :-1].cuda(), torch.arange(cfg.seq_len).expand(2, -1).cuda()
    held, sent = {}, None
    for count in (0, 2):
        model, rt, _ = build_as_train(replace(cfg, offload_activations=count))
        model(ids, positions, labels.cuda()).backward()  # warm-up: first-call allocations
        model.zero_grad(set_to_none=True)
        before = settled_memory_allocated()
        loss = model(ids, positions, labels.cuda())
        held[count] = settled_memory_allocated() - before
        loss.backward()
        if count:
            offloader = model.activation_offload
            buffers = [b for free in offloader.host_buffers.free.values() for b in free]
            assert buffers and all(piece.is_pinned() for b in buffers for piece in b.pieces)
            sent = offloader.stats["offloaded_bytes"]
            assert offloader.stats["prefetched"] == offloader.stats["restored"] > 0
        del model, loss
    assert sent and held[0] - held[2] >= 0.9 * sent, (held, sent)
    # The streams' order: a missing wait would let a copy read a tensor not yet computed, the
    # compute stream read a copy back not yet done, or reuse memory a copy out still reads.
    # Delay each side of it in turn and compare with the step without 07, bit for bit (the
    # math attention kernel: deterministic).
    exact = replace(cfg, attn_kernel="math")
    _, grads_kept = train_loss_and_grads(replace(exact, offload_activations=0), tokens, labels)
    def sleeping(stream_of, work):  # work(...) after a sleep of ~1 ms queued on stream_of()
        def run(*args):
            with torch.cuda.stream(stream_of()):
                torch.cuda._sleep(2_000_000)
            return work(*args)
        return run

    for delayed in ("side", "compute"):
        model, rt, _ = build_as_train(exact)
        offloader = model.activation_offload
        if delayed == "side":  # every copy starts late
            side_stream = offloader.side_stream
            offloader.side_stream = sleeping(lambda: side_stream(torch.device("cuda")),
                                             side_stream)
        else:  # the compute queued before each copy finishes late
            offloader.send = sleeping(torch.cuda.current_stream, offloader.send)
            offloader.bring_back = sleeping(torch.cuda.current_stream, offloader.bring_back)
        train.forward_backward(model, tokens, rt, labels)
        assert all(torch.equal(full(p.grad), grads_kept[n])
                   for n, p in model.named_parameters()), delayed
