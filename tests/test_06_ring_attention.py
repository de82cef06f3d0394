"""06_ring_attention.py: the ring equals unsharded causal attention (output and every input
gradient, packed documents included), the ring acts (two K/V blocks in flight at most, bytes
per rank falling with R), it composes with Ulysses (02) and the model, and bad layouts are
refused. CPU, gloo, fp32."""

import copy
import importlib
import weakref
from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from reference import assert_within_bf16_error, plain_attention_results

import model as llama
from base import kernels
from support.demos import LargestTensor, measure_stage_memory
from support import byte_counts

ring_attn = importlib.import_module("06_ring_attention")
ulysses = importlib.import_module("02_ulysses")

HEAD_CASES = [(4, 4), (4, 2), (4, 1)]  # MHA, GQA, MQA
HEAD_DIM, BATCH = 8, 2
CLOSE = dict(rtol=1e-5, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# One process: the kernels without the causal mask, the merge, the layout, the checks.
# ---------------------------------------------------------------------------------------------

def plain_attention(q, k, v, causal):
    """softmax(q k^T / sqrt(D)) v, written out (GQA by repeating K/V heads): (out, lse)."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1),
                                    float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), v), lse


@pytest.mark.parametrize("kernel", [None, "math"])  # None: this process's CPU kernel
def test_full_block_kernels_equal_the_plain_formula(kernel):
    """causal=False: queries and keys of different lengths, every query sees every key."""
    for n_heads, n_kv_heads in HEAD_CASES:
        g = torch.Generator().manual_seed(n_heads + n_kv_heads)
        q, grad_out = (torch.randn(BATCH, 5, n_heads, HEAD_DIM, generator=g) for _ in range(2))
        k, v = (torch.randn(BATCH, 9, n_kv_heads, HEAD_DIM, generator=g) for _ in range(2))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = plain_attention(*ref, causal=False)
        ref_out.backward(grad_out)
        out, lse = kernels.attention_forward_lse(q, k, v, kernel, causal=False)
        grads = kernels.attention_backward_lse(grad_out, q, k, v, out, lse, kernel, causal=False)
        what = f"{kernel} heads={n_heads}/{n_kv_heads}"
        torch.testing.assert_close(out, ref_out.detach(), **CLOSE, msg=lambda m: f"{what} out: {m}")
        torch.testing.assert_close(lse.reshape(ref_lse.shape), ref_lse.detach(), **CLOSE)
        for name, got, want in zip("qkv", grads, ref):
            torch.testing.assert_close(got, want.grad, **CLOSE,
                                       msg=lambda m: f"{what} d{name}: {m}")
    with pytest.raises(ValueError, match=r"as many queries \(5\) as keys \(9\)"):
        kernels.attention_forward_lse(q, k, v, kernel)
    with pytest.raises(ValueError, match="causal=False"):
        kernels.attention_forward_lse(q, q, q, kernel, cu_seqlens=(0, 5, 10), causal=False)


def test_merge_is_attention_over_the_union_of_keys_and_never_nan():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(BATCH, 6, 4, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, 10, 2, HEAD_DIM, generator=g) for _ in range(2))
    want_out, want_lse = plain_attention(q, k, v, causal=False)
    parts = [kernels.attention_forward_lse(q, k[:, keys], v[:, keys], causal=False)
             for keys in (slice(0, 3), slice(3, 10))]
    for order in (parts, parts[::-1]):
        out = torch.zeros(q.shape)
        lse = torch.full((BATCH, 4, 6), float("-inf"))
        # rows 0-2 of the first block saw no key (lse -inf, out 0): they must merge as nothing
        block_out, block_lse = torch.zeros(q.shape), torch.full((BATCH, 4, 6), float("-inf"))
        block_lse[:, :, 3:] = 0.0
        ring_attn.merge(out, lse, block_out, block_lse)
        assert not out.isnan().any() and (lse[:, :, :3] == float("-inf")).all()
        lse.fill_(float("-inf"))  # start again from nothing, with the real blocks
        out.zero_()
        for block_out, block_lse in order:
            ring_attn.merge(out, lse, block_out, block_lse)
        torch.testing.assert_close(out, want_out, **CLOSE)
        torch.testing.assert_close(lse, want_lse, **CLOSE)


def test_zigzag_order_and_its_balance():
    assert ring_attn.zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert ring_attn.zigzag_order(6, 1).tolist() == list(range(6))
    order = ring_attn.zigzag_order(48, 4)
    assert sorted(order.tolist()) == list(range(48))  # a permutation: every token once
    # What it claims, written from the definition (not from zigzag_chunks): ring rank i holds
    # chunk i of the 2R = 8 chunks of 6 tokens, then chunk 2R-1-i, each in order.
    for rank in range(4):
        held = [chunk * 6 + t for chunk in (rank, 7 - rank) for t in range(6)]
        assert order.view(4, -1)[rank].tolist() == held, rank
    # every rank's queries see the same number of keys (causal work): sum of (position + 1)
    work = [int((order.view(4, -1)[rank] + 1).sum()) for rank in range(4)]
    assert len(set(work)) == 1, work


def test_check_ring_refuses_clearly():
    with pytest.raises(ValueError, match=r"ring degree R \(0\) must be at least 1"):
        ring_attn.check_ring(4, 0)
    with pytest.raises(ValueError,
                       match=r"R \(3\) must divide the sequence-parallel degree P \(4\)"):
        ring_attn.check_ring(4, 3)
    with pytest.raises(ValueError, match=r"sequence length \(36\) must be divisible by the "
                                         r"sequence-parallel degree \(8\)"):
        ring_attn.check_ring(8, 2, 36)  # 2R = 4 divides 36, P = 8 does not
    with pytest.raises(ValueError, match=r"sequence length \(18\) must be divisible by 2R = 12"):
        ring_attn.zigzag_order(18, 6)  # P = 6 divides 18, 2R = 12 does not
    ring_attn.check_ring(8, 2, 40)


def test_planned_ring_bytes_fall_with_the_ring():
    args = llama.get_model_args("llama3-8b")
    planned = [byte_counts.ring_attention_bytes(args, 3 * 2**20, 8 * ring, ring)
               for ring in (1, 2, 4, 8)]
    assert planned == sorted(planned, reverse=True), planned
    for ring, nbytes in zip((2, 4, 8), planned[1:]):  # every buffer holds S/R tokens
        assert abs(nbytes * ring / planned[0] - 1) < 0.01, planned


def test_ring_buffer_bytes_by_hand():
    """A ring rank's buffers over N = 2^20 tokens (two chunks of C = N/2), 4 query heads and 1
    KV head of 128, bf16, cuDNN: K/V blocks in flight (2 x 2NKD x 2 bytes), dK/dV in flight in
    fp32 (2 x 2NKD x 4), dq summed in fp32 (NHD x 4), up to 3 block pairs' K/V gradients (3 x
    2CKD x 2), one block pair's dq (CHD x 2) and the kernel's workspace over C tokens (its fp32
    dq, grouped dk/dv per query head, an fp32 row sum)."""
    n, h, kv, d = 2**20, 4, 1, 128
    c = n // 2
    workspace = 4 * c * h * d + 2 * c * h * d * 2 + 4 * c * h
    assert byte_counts.ring_buffer_bytes(n, h, kv, d) == (
        2 * 2 * n * kv * d * 2 + 2 * 2 * n * kv * d * 4 + n * h * d * 4
        + 3 * 2 * c * kv * d * 2 + c * h * d * 2 + workspace)


# ---------------------------------------------------------------------------------------------
# R ranks: the ring against unsharded attention.
# ---------------------------------------------------------------------------------------------

def documents(seq_len: int, chunk: int) -> tuple:
    """Two rows of packed documents: a document spanning chunks, 1-token documents, a document
    starting exactly at a chunk boundary; the second row one long document after a short one."""
    row0 = sorted({0, chunk + 1, chunk + 2, 2 * chunk, seq_len - 1} - {seq_len})
    row1 = [0, 3]
    return tuple(row0 + [seq_len + b for b in row1] + [2 * seq_len])


def reference(q, k, v, grad_out, cu_seqlens=None):
    """Unsharded causal attention in the original order, each document alone: out, dq, dk, dv."""
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    if cu_seqlens is None:
        out = kernels.causal_attention(*ref)
    else:
        seq_len = q.shape[1]
        rows = [[] for _ in range(q.shape[0])]
        for row, start, end in kernels.document_spans(cu_seqlens, q.shape[0], seq_len):
            rows[row].append(kernels.causal_attention(*(t[row:row + 1, start:end] for t in ref)))
        out = torch.cat([torch.cat(r, dim=1) for r in rows])
    out.backward(grad_out)
    return [out.detach()] + [t.grad for t in ref]


def gather_sequence(local, group, order):
    """The ranks' local pieces (zigzag order) -> the whole sequence in the original order."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    return torch.cat(pieces, dim=1)[:, order.argsort()]


def check_equals_unsharded(attention, group, sp_rank, sp, ring, n_heads, n_kv_heads, chunk,
                           packed=False, seed=0):
    """`attention` (local q, k, v, cu_seqlens -> out) on this rank's piece of the zigzag-ordered
    sequence equals the unsharded reference: output and every input gradient."""
    seq_len = 2 * ring * chunk
    g = torch.Generator().manual_seed(seed)
    q, grad_out = (torch.randn(BATCH, seq_len, n_heads, HEAD_DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(BATCH, seq_len, n_kv_heads, HEAD_DIM, generator=g) for _ in range(2))
    cu_seqlens = documents(seq_len, chunk) if packed else None
    want = reference(q, k, v, grad_out, cu_seqlens)
    order = ring_attn.zigzag_order(seq_len, ring)
    mine = slice(sp_rank * seq_len // sp, (sp_rank + 1) * seq_len // sp)
    local = [t[:, order][:, mine].clone().requires_grad_() for t in (q, k, v)]
    out = attention(*local, cu_seqlens=cu_seqlens)
    out.backward(grad_out[:, order][:, mine])
    what = f"R={ring} P={sp} heads={n_heads}/{n_kv_heads} packed={packed}"
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [t.grad for t in local], want):
        torch.testing.assert_close(gather_sequence(got.detach(), group, order), ref, **CLOSE,
                                   msg=lambda m: f"{what} {name}: {m}")


def track_received(peak: dict):
    """Make the ring count the bytes of the buffers it receives that are still alive (in
    peak['live']), and their peak (peak['bytes']); returns a function that resets the peak."""
    original = ring_attn.pass_to_next
    live = peak.setdefault("live", {"bytes": 0})

    def release(nbytes):
        live["bytes"] -= nbytes

    def tracked(tensors, group):
        received, wait = original(tensors, group)
        for t in received:
            live["bytes"] += t.nbytes
            peak["bytes"] = max(peak["bytes"], live["bytes"])
            weakref.finalize(t, release, t.nbytes)
        return received, wait

    ring_attn.pass_to_next = tracked
    return lambda: peak.update(bytes=0)


def transfers_and_overlaps(run) -> tuple[int, int]:
    """While `run()` runs: how many ring transfers start, and how many of them have a block's
    kernel call between their start and the wait for their arrival (the transfer hidden
    behind the compute, which is what makes the ring cost little more than the kernel)."""
    events, originals = [], (ring_attn.pass_to_next, ring_attn.forward_step,
                             ring_attn.backward_step)

    def passing(tensors, group):
        received, wait = originals[0](tensors, group)
        number = sum(event[0] == "start" for event in events)
        events.append(("start", number))

        def waited():
            events.append(("arrived", number))
            wait()
        return received, waited

    def computing(original):
        def step(*args, **kwargs):
            events.append(("compute", None))
            return original(*args, **kwargs)
        return step

    ring_attn.pass_to_next = passing
    ring_attn.forward_step, ring_attn.backward_step = map(computing, originals[1:])
    try:
        run()
    finally:
        ring_attn.pass_to_next, ring_attn.forward_step, ring_attn.backward_step = originals
    starts = {n: i for i, (kind, n) in enumerate(events) if kind == "start"}
    arrivals = {}
    for i, (kind, n) in enumerate(events):
        if kind == "arrived":
            arrivals.setdefault(n, i)  # the first wait is the one that counts
    overlapped = sum(any(kind == "compute" for kind, _ in events[starts[n]:arrivals[n]])
                     for n in starts)
    return len(starts), overlapped


def check_transfers_overlap_compute(group, ring: int):
    """Forward: the R-1 K/V blocks each travel during a block's kernel. Backward: the R-1 K/V
    blocks and R travelling dK/dV, all but the last dK/dV (home, after the last kernel) too."""
    q = torch.randn(1, 8, 4, HEAD_DIM, requires_grad=True)
    k, v = (torch.randn(1, 8, 2, HEAD_DIM) for _ in range(2))
    result = {}
    forward = transfers_and_overlaps(
        lambda: result.update(out=ring_attn.ring_attention(q, k, v, group)))
    backward = transfers_and_overlaps(lambda: result["out"].sum().backward())
    assert forward == (ring - 1, ring - 1), forward
    assert backward == (2 * ring - 1, 2 * ring - 2), backward


def check_key_grads_travel_in_fp32(group, ring: int):
    """In bf16, the dK/dV that travel the ring are fp32 sums (the K/V themselves bf16): each
    rank adds its share into them, R additions in bf16 would each round."""
    q = torch.randn(1, 8, 4, HEAD_DIM, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 8, 2, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2))
    out = ring_attn.ring_attention(q, k, v, group)
    sent, original = [], ring_attn.pass_to_next

    def passing(tensors, group):
        sent.extend(t.dtype for t in tensors)
        return original(tensors, group)

    ring_attn.pass_to_next = passing
    try:
        out.float().sum().backward()
    finally:
        ring_attn.pass_to_next = original
    # R - 1 K/V blocks and R travelling dK/dV, two tensors each
    assert sorted(map(str, sent)) == sorted(["torch.bfloat16"] * 2 * (ring - 1)
                                            + ["torch.float32"] * 2 * ring), sent


def _ring_equals_unsharded():
    """The whole world is one ring: every head case, packed documents, and (world 2) rings of
    one rank; then what the ring holds while it runs."""
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    ring_of = partial(ring_attn.ring_attention, group=group)
    for n_heads, n_kv_heads in HEAD_CASES:
        check_equals_unsharded(ring_of, group, rank, world, world, n_heads, n_kv_heads, chunk=3)
    check_equals_unsharded(ring_of, group, rank, world, world, 4, 2, chunk=4, packed=True)
    check_transfers_overlap_compute(group, world)
    if world == 2:  # R = 1: each rank alone is a ring over the whole sequence
        alone = [dist.new_group([r]) for r in range(world)][rank]
        check_equals_unsharded(partial(ring_attn.ring_attention, group=alone), alone, 0, 1, 1,
                               4, 2, chunk=6, packed=True)
        return
    # The ring acts: K/V blocks of S/R tokens arrive and leave, two at most in forward (the one
    # in use and the one arriving), plus two travelling dK/dV in backward; no tensor of the
    # whole sequence exists (with MHA, gathered K/V would be R times the fp32 output buffer).
    peak = {"bytes": 0}
    reset = track_received(peak)
    chunk, n_heads = 4, 4
    q = torch.randn(1, 2 * chunk, n_heads, HEAD_DIM, requires_grad=True)
    k, v = (torch.randn(1, 2 * chunk, n_heads, HEAD_DIM) for _ in range(2))
    kv_block = 2 * k.nbytes
    # at each forward step, the received bytes alive: at the last (nothing more arriving) only
    # the block in use; the blocks used before it are gone (at R = 3 the peak alone would pass
    # with them kept: one in use and one arriving is also two)
    at_step, forward_step = [], ring_attn.forward_step
    ring_attn.forward_step = lambda *a, **kw: (at_step.append(peak["live"]["bytes"]),
                                               forward_step(*a, **kw))
    try:
        with LargestTensor() as largest:
            out = ring_attn.ring_attention(q, k, v, group)
            forward_peak = peak["bytes"]
            reset()
            out.sum().backward()
    finally:
        ring_attn.forward_step = forward_step
    assert at_step[-1] == kv_block, (at_step, kv_block)
    check_key_grads_travel_in_fp32(group, ring=world)
    assert forward_peak == 2 * kv_block, (forward_peak, kv_block)
    assert peak["bytes"] == 4 * kv_block, (peak["bytes"], kv_block)  # + dK/dV (fp32 here)
    assert largest.nbytes == q.numel() * 4, (largest.shape, q.shape)  # the fp32 accumulators


# World 3 in the quick loop: the ring's two-K/V-blocks memory shows only from R = 3.
@pytest.mark.parametrize("world_size", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_equals_unsharded_attention(world_size):
    run_ranks(world_size, _ring_equals_unsharded)


# ---------------------------------------------------------------------------------------------
# 4 ranks: bytes per rank fall with R; Ulysses x ring, alone and in the model.
# ---------------------------------------------------------------------------------------------

def _hybrid_and_bytes():
    world, rank = dist.get_world_size(), dist.get_rank()
    # Attention bytes per rank at one sequence length, R = 1, 2, 4.
    seq_len, measured = 32, {}
    for ring in (1, 2, 4):
        groups = [dist.new_group(list(range(s, s + ring))) for s in range(0, world, ring)]
        group = groups[rank // ring]
        q = torch.randn(1, seq_len // ring, 4, HEAD_DIM, requires_grad=True)
        k, v = (torch.randn(1, seq_len // ring, 2, HEAD_DIM) for _ in range(2))
        measured[ring] = measure_stage_memory(partial(ring_attn.ring_attention, group=group), q,
                                              (k, v))
    assert measured[1] == 2 * measured[2] == 4 * measured[4], measured

    # Ulysses (P/R = 2) around the ring (R = 2): heads need only divide 2.
    mesh = ring_attn.ring_ulysses_mesh("cpu", sp=4, ring=2)
    ring_group, ulysses_group = mesh["ring"].get_group(), mesh["ulysses"].get_group()
    assert dist.get_process_group_ranks(ulysses_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(ring_group) == [rank % 2, rank % 2 + 2]
    hybrid = partial(ulysses.ulysses_attention, group=ulysses_group,
                     kernel=partial(ring_attn.ring_attention, group=ring_group))
    for n_heads, n_kv_heads, packed in [(6, 2, False), (4, 1, False), (2, 2, True)]:
        check_equals_unsharded(hybrid, dist.group.WORLD, rank, world, 2, n_heads, n_kv_heads,
                               chunk=4, packed=packed)

    # The model: zigzag order applied to ids, labels and global positions before the split;
    # loss and every gradient equal the unsharded model's.
    args = llama.get_model_args("tiny")
    reference_model = llama.Transformer(args)
    llama.init_weights(reference_model, 0)
    ring_model = copy.deepcopy(reference_model)
    ring_attn.apply_ring(ring_model, ulysses_group, ring_group)
    seq_len = 32
    tokens = torch.randint(0, args.vocab_size, (2, seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    input_ids, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 5:9] = llama.IGNORE_INDEX
    positions = torch.arange(seq_len).expand(2, -1)
    count = (labels != llama.IGNORE_INDEX).sum()
    ref_loss = reference_model(input_ids, positions, labels) / count
    ref_loss.backward()
    order = ring_attn.zigzag_order(seq_len, 2)
    mine = slice(rank * seq_len // 4, (rank + 1) * seq_len // 4)
    loss = ring_model(*(t[:, order][:, mine] for t in (input_ids, positions, labels))) / count
    loss.backward()
    dist.all_reduce(loss := loss.detach())
    torch.testing.assert_close(loss, ref_loss.detach(), **CLOSE)
    for (name, p), ref in zip(ring_model.named_parameters(), reference_model.parameters()):
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match=r"query heads \(5\) to be divisible by .* \(2\)"):
        ring_attn.apply_ring(llama.Transformer(replace(args, n_heads=5)), ulysses_group, ring_group)


@pytest.mark.slow
def test_bytes_fall_with_ring_and_ulysses_times_ring_equals_unsharded():
    run_ranks(4, _hybrid_and_bytes)


# ---------------------------------------------------------------------------------------------
# GPU: the kernels' full blocks, and the ring's block pairs in one process (bench/ring_blocks.py).
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", pytest.param("fa4", marks=pytest.mark.skipif(
    not kernels.fa4_installed(), reason="flash-attn-4 not installed"))])
def test_gpu_kernels_full_blocks_and_ring_schedule_in_bf16(kernel):
    """bf16 on the GPU against fp32, by the one bf16 rule (tests/reference.py): a full block
    (300 queries, 700 keys), whose unsharded run is SDPA's bf16 call, and the ring's schedule
    (R = 2, 3), whose unsharded run is one causal call of the kernel over the whole sequence."""
    from bench import ring_blocks

    kernels.use_kernel(kernel)
    names = ("out", "dq", "dk", "dv")
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 300, 4, 64, generator=g).bfloat16().float()
        k, v = (torch.randn(1, 700, 2, 64, generator=g).bfloat16().float() for _ in range(2))
        grad_out = torch.randn(1, 300, 4, 64, generator=g).bfloat16().float()
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out, _ = plain_attention(*ref, causal=False)
        ref_out.backward(grad_out)
        reference = dict(zip(names, (ref_out.detach(), *(t.grad for t in ref))))
        cuda = [t.cuda().bfloat16() for t in (q, k, v, grad_out)]
        unsharded = dict(zip(names, plain_attention_results(*cuda, causal=False)))
        out, lse = kernels.attention_forward_lse(*cuda[:3], causal=False)
        grads = kernels.attention_backward_lse(cuda[3], *cuda[:3], out, lse, causal=False)
        assert_within_bf16_error(dict(zip(names, (out, *grads))), unsharded, reference,
                                 f"{kernel} full block")
        seq_len = 1536
        q, k, v, grad_out = ring_blocks.inputs(seq_len, 16, 4, 128, torch.device("cuda"),
                                               torch.bfloat16)
        reference = dict(zip(names, ring_blocks.fp32_reference(q, k, v, grad_out)))
        single = dict(zip(names, ring_blocks.single_call(q, k, v, grad_out)))
        for ring in (2, 3):
            order = ring_attn.zigzag_order(seq_len, ring).cuda()
            got = ring_blocks.ring_schedule(*(t[:, order] for t in (q, k, v, grad_out)), ring)
            got = dict(zip(names, (t[:, order.argsort()] for t in got)))
            assert_within_bf16_error(got, single, reference, f"{kernel} ring {ring}")
    finally:
        kernels.use_kernel("auto")


@pytest.mark.slow
def test_ring_blocks_benchmark_runs_on_cpu(tmp_path):
    """bench/ring_blocks.py's CPU smoke form (its numbers mean nothing on a CPU): it runs, the
    ring's schedule is exact in fp32, and it writes its JSON."""
    import json

    from bench import ring_blocks

    ring_blocks.main(["--device", "cpu", "--model", "tiny", "--ulysses", "1", "--seq-len", "64",
                      "--check-seq-len", "32", "--rings", "1", "2", "--kernels", "auto",
                      "--repeats", "1", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "ring_blocks_cpu.json").read_text())["rows"]
    assert [row["ring"] for row in rows] == [None, 1, 2]
    for row in rows:
        assert row["time_s"] > 0 and max(row["max_abs_error"].values()) < 1e-4, row
