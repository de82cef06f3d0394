"""06 - Ring attention: share one sequence over more GPUs than there are heads.

The problem in bytes. Ulysses (02, 05) gives every GPU whole heads of the whole sequence, so the
sequence-parallel degree P stops at the head count and the heads must divide it: Llama-3-8B (32
query heads, 8 KV heads) cannot share one sequence over 64 GPUs, a model with 28 or 40 heads not
over 16. At P = 32 each GPU still attends over all S tokens of its one head, S x 128 x 2 bytes:
0.75 GiB at 3M tokens, 5 GiB at 20M; attention holds about ten such tensors (q, k, v, the
output, their gradients, fp32 dq), ~50 GiB at 20M tokens, and no further GPU can take any of it.

The idea. Split the sequence itself over a ring of R ranks. Each rank keeps its queries; the K/V
blocks travel from rank to rank (point-to-point, overlapped with the kernel), so after R steps
every query has met every key, with at most two K/V blocks per rank: the one in use and the one
arriving. Each step gives a partial output and its log-sum-exp (lse); two partials merge exactly,
in fp32: the softmax over the union of two key sets is their outputs weighted by
exp(lse_part - lse_union). The zigzag layout balances the causal work: cut the sequence into 2R
chunks, rank i holds chunks i and 2R-1-i (one early, one late); query chunk a meets key chunk b
fully if b < a, causally if b == a, not at all if b > a. Backward is a second ring: K/V travel
again with their gradients dK/dV (fp32), each rank adding its share, home after R steps; dQ
stays local. Each block's backward uses the forward's merged output and lse: no forward reruns.

Ulysses x ring: P = (P/R) x R, Ulysses over P/R ranks inside a node (all-to-all over NVLink),
ring over R across nodes; the heads need only divide P/R, and each rank attends over S/R tokens:
`ulysses_attention(q, k, v, group, kernel=partial(ring_attention, group=ring_group))`.

Packed documents: `cu_seqlens` are global offsets in the original token order (kernels.py); each
block pair attends only within each document's part of both chunks, so the result is exact. The
data is put in zigzag order (`zigzag_order`) before it is split, labels shifted before that, and
positions are the global token indices, so rotary and the loss need nothing else.

    torchrun --nproc-per-node 2 06_ring_attention.py               # CPU/gloo or GPUs
    torchrun --nproc-per-node 4 06_ring_attention.py --model llama3-8b --seq-len 256K   # GPUs
"""

import importlib
from functools import partial

import torch
import torch.distributed as dist

from base import checkpointed, kernels

ulysses = importlib.import_module("02_ulysses")
untied_ulysses = importlib.import_module("05_untied_ulysses")

NO_KEY = float("-inf")  # the lse of a query row that has seen no key yet


# The ring: this rank's queries meet every rank's K/V, one block per step.

def ring_attention_forward(q, k, v, group, cu_seqlens=None):
    """q (B, 2C, H, D), k/v (B, 2C, Hkv, D): this ring rank's two zigzag chunks of C tokens
    (S = 2RC) -> (out like q, lse fp32 (B, H, 2C) over every key each query saw)."""
    ring, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, local_len, n_heads, _ = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full((batch, n_heads, local_len), NO_KEY, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    for step in range(ring):
        owner = (rank - step) % ring  # whose K/V this rank holds now
        if step + 1 < ring:
            next_kv, kv_arrived = pass_to_next(kv, group)  # travels while the kernel runs
        forward_step(q, *kv, out, lse, rank, owner, ring, cu_seqlens)
        if step + 1 < ring:
            kv_arrived()
            kv = next_kv  # the block just used is dropped: two K/V blocks at most
    return out.to(q.dtype), lse


def ring_attention_backward(grad_out, q, k, v, out, lse, group, cu_seqlens=None):
    """(dq, dk, dv) of `ring_attention_forward` from its out and lse: K/V travel the ring again,
    and the gradient of each block travels with it (fp32), each rank adding its share."""
    ring, rank = dist.get_world_size(group), dist.get_rank(group)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k.contiguous(), v.contiguous())
    next_dkv = dkv_arrived = None  # the travelling dK/dV: each step sends it on for the next one
    for step in range(ring):
        owner = (rank - step) % ring
        if step + 1 < ring:
            next_kv, kv_arrived = pass_to_next(kv, group)
        key_grads = backward_step(grad_out, q, *kv, out, lse, dq, rank, owner, ring, cu_seqlens)
        if step == 0:
            dkv = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]
        else:
            dkv_arrived()  # the owner's dK/dV from the ranks that held this block before
            dkv = next_dkv
        add_key_grads(*dkv, key_grads)
        # on to the rank that holds this K/V next; after the last step that is its owner
        next_dkv, dkv_arrived = pass_to_next(dkv, group)
        if step + 1 < ring:
            kv_arrived()
            kv = next_kv
    dkv_arrived()
    dk, dv = next_dkv  # this rank's own block, home
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def pass_to_next(tensors, group):
    """Start sending `tensors` to the next rank of the ring and receiving the same shapes from
    the previous one. Returns (received, wait); both run while this rank computes."""
    ring, rank = dist.get_world_size(group), dist.get_rank(group)
    if ring == 1:
        return tensors, lambda: None
    send_to = dist.get_global_rank(group, (rank + 1) % ring)
    receive_from = dist.get_global_rank(group, (rank - 1) % ring)
    received = [torch.empty_like(t) for t in tensors]
    requests = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, t, send_to, group) for t in tensors]
        + [dist.P2POp(dist.irecv, t, receive_from, group) for t in received])

    def wait():
        for request in requests:
            request.wait()
        requests.clear()  # the requests hold the sent tensors: let them go once they are sent
    return received, wait


# One step of the ring, on one rank (bench/ring_blocks.py runs every rank's steps in one process).

def forward_step(q, k, v, out, lse, rank, owner, ring, cu_seqlens=None):
    """This rank's queries against the owner's K/V, block pair by block pair, each partial
    result merged into the fp32 accumulators `out` and `lse`."""
    for rows, queries, keys, causal in block_pairs(q.shape, rank, owner, ring, cu_seqlens):
        block_out, block_lse = kernels.attention_forward_lse(
            q[rows, queries], k[rows, keys], v[rows, keys], piece_kernel(queries, keys),
            causal=causal)
        merge(out[rows, queries], lse[rows, :, queries], block_out, block_lse)


def merge(out, lse, block_out, block_lse):
    """Fold one block's partial attention into the running one of the same query rows, in place:
    softmax over the union of both key sets. out (b, s, H, D) and lse (b, H, s) are fp32. A row
    that has seen no key on either side stays out 0, lse -inf (no NaN from -inf - -inf)."""
    block_lse = block_lse.reshape(lse.shape)  # cuDNN's lse is (b, H, s, 1)
    new_lse = torch.logaddexp(lse, block_lse)
    finite = new_lse.masked_fill(new_lse == NO_KEY, 0.0)
    weight = lambda part: (part - finite).exp().transpose(1, 2)[..., None]  # (b, s, H, 1)
    out.mul_(weight(lse)).addcmul_(block_out, weight(block_lse))
    lse.copy_(new_lse)


def backward_step(grad_out, q, k, v, out, lse, dq, rank, owner, ring, cu_seqlens=None):
    """The backward of `forward_step` with the merged out and lse: adds this step's share of dq
    into `dq` (fp32) and returns the owner's K/V gradients from this rank's queries, as
    (rows, keys, dk, dv) pieces (the ring adds them to the travelling dK/dV once it arrives)."""
    key_grads = []
    for rows, queries, keys, causal in block_pairs(q.shape, rank, owner, ring, cu_seqlens):
        dq_piece, dk_piece, dv_piece = kernels.attention_backward_lse(
            grad_out[rows, queries], q[rows, queries], k[rows, keys], v[rows, keys],
            out[rows, queries], lse[rows, :, queries].contiguous(), piece_kernel(queries, keys),
            causal=causal)
        dq[rows, queries] += dq_piece
        key_grads.append((rows, keys, dk_piece, dv_piece))
    return key_grads


def add_key_grads(dk, dv, key_grads) -> None:
    for rows, keys, dk_piece, dv_piece in key_grads:
        dk[rows, keys] += dk_piece
        dv[rows, keys] += dv_piece


# The zigzag layout: which chunks meet at each step.

def zigzag_chunks(rank: int, ring: int) -> tuple[int, int]:
    """The two of the 2R chunks that ring rank `rank` holds: one early, one late."""
    return rank, 2 * ring - 1 - rank


def zigzag_order(seq_len: int, ring: int) -> torch.Tensor:
    """Token indices in ring order: ring rank 0's two chunks, then rank 1's, ... Apply it to the
    sequence before splitting (x[:, order]); argsort(order) undoes it."""
    check_ring(ring, ring, seq_len)
    chunks = torch.arange(seq_len).view(2 * ring, -1)
    return torch.cat([chunks[list(zigzag_chunks(r, ring))].flatten() for r in range(ring)])


def block_pairs(shape, rank, owner, ring, cu_seqlens=None) -> list:
    """What meets in one step: (batch rows, query positions, key positions, causal) in the local
    tensors of this rank (queries) and of `owner` (keys), shape (B, 2C, ...). Query chunk a meets
    key chunk b fully if b < a, causally if b == a, not at all if b > a (keys after queries),
    and only within a span of the sequence: the whole rows, or each packed document."""
    batch, chunk = shape[0], shape[1] // 2
    seq_len = 2 * ring * chunk
    spans = ([(slice(None), 0, seq_len)] if cu_seqlens is None else  # (rows, start, end)
             [(slice(r, r + 1), start, end)
              for r, start, end in kernels.document_spans(cu_seqlens, batch, seq_len)])
    pairs = []
    for q_slot, a in enumerate(zigzag_chunks(rank, ring)):
        for k_slot, b in enumerate(zigzag_chunks(owner, ring)):
            for rows, start, end in spans if b <= a else ():
                queries = local_part(start, end, a, q_slot, chunk)
                keys = local_part(start, end, b, k_slot, chunk)
                if queries.start < queries.stop and keys.start < keys.stop:  # span in both
                    pairs.append((rows, queries, keys, b == a))
    return pairs


def local_part(start: int, end: int, chunk_index: int, slot: int, chunk: int) -> slice:
    """Positions [start, end) of the original order that fall into chunk `chunk_index`, as
    positions of the local tensor that holds that chunk in `slot` (0 or 1)."""
    first = chunk_index * chunk
    return slice(max(start, first) - first + slot * chunk,
                 min(end, first + chunk) - first + slot * chunk)


def piece_kernel(queries: slice, keys: slice) -> str | None:
    """The kernel for a block pair of `queries` and `keys` (None: the process's own)."""
    return kernels.kernel_for_length(min(queries.stop - queries.start,
                                         keys.stop - keys.start), None)


# Autograd, and the model's seam: `ring_attention` has kernels.causal_attention's call signature.

class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, cu_seqlens):
        out, lse = checkpointed.forward_or_kept(  # --keep-attention: not rerun in recompute
            ring_attention_forward, q, k, v, group, cu_seqlens)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.cu_seqlens = group, cu_seqlens
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grads = ring_attention_backward(grad_out, *ctx.saved_tensors, ctx.group, ctx.cu_seqlens)
        return (*grads, None, None)


def ring_attention(q, k, v, group, cu_seqlens=None):
    """Causal attention of this ring rank's zigzag chunks against the whole sequence."""
    return RingAttention.apply(q, k, v, group, cu_seqlens)


def ring_ulysses_mesh(device_type: str, sp: int, ring: int):
    """Ranks as a (dp, ring, ulysses) grid: Ulysses over P/R contiguous ranks (one node's fast
    links), the ring over R ranks at stride P/R. Sequence-parallel rank p = ring rank x P/R +
    Ulysses rank holds the p-th of P pieces of the zigzag-ordered sequence."""
    from torch.distributed.device_mesh import init_device_mesh

    check_ring(sp, ring)
    world = dist.get_world_size()
    ulysses.check_data_sequence_layout(world, sp)
    return init_device_mesh(device_type, (world // sp, ring, sp // ring),
                            mesh_dim_names=("dp", "ring", "ulysses"))


def apply_ring(model, ulysses_group, ring_group, untied: bool = False,
               head_chunk: int | None = None) -> None:
    """Every attention layer of `model`: Ulysses (02) over `ulysses_group` around ring attention
    over `ring_group`; with untied, Untied Ulysses (05) whose every stage runs the ring. The
    batch must be in zigzag order (`zigzag_order`) before it is split."""
    ulysses_size, ring = dist.get_world_size(ulysses_group), dist.get_world_size(ring_group)
    check_ring(ulysses_size * ring, ring)
    if untied:
        stage_attention = (partial(ring_attention_forward, group=ring_group),
                           partial(ring_attention_backward, group=ring_group))
        untied_ulysses.apply_untied_ulysses(model, ulysses_group, head_chunk, stage_attention)
        return
    ulysses.check_ulysses_shapes(model.args.n_heads, model.args.n_kv_heads, ulysses_size)
    ring_kernel = partial(ring_attention, group=ring_group)
    for block in model.layers:
        block.self_attn.core = partial(ulysses.ulysses_attention, group=ulysses_group,
                                       kernel=ring_kernel)


# ---- below: checks, demo -------------------------------------------------------------------------

def check_ring(sp: int, ring: int, seq_len: int | None = None) -> None:
    """Raise ValueError naming the numbers when a ring of `ring` ranks cannot split this run."""
    if ring < 1:
        raise ValueError(f"the ring degree R ({ring}) must be at least 1")
    if sp % ring:
        raise ValueError(f"the ring degree R ({ring}) must divide the sequence-parallel degree "
                         f"P ({sp}): Ulysses runs over P/R ranks inside each ring rank")
    if seq_len is not None:
        ulysses.check_sequence_split(seq_len, sp, ring)


# Demo: attention bytes per rank for R = 1, 2, 4 (as ranks allow), each ring over all S tokens.

def main():
    from support.byte_counts import ring_attention_bytes
    from support.demos import (attention_demo_setup, end_ranks, measure_stage_memory,
                               measured_what, print_measured_and_planned)

    demo = attention_demo_setup("06_ring_attention.py")
    args, seq_len, world, rank = demo.args, demo.seq_len, demo.world, demo.rank
    rings = [r for r in (1, 2, 4) if world % r == 0]
    try:  # every ring degree, before any work
        for ring in rings:
            check_ring(ring, ring, seq_len)
    except ValueError as error:
        raise SystemExit(f"error: {error}")
    rows = []
    for ring in rings:
        groups = [dist.new_group(list(range(first, first + ring)))
                  for first in range(0, world, ring)]
        local = seq_len // ring
        q, k, v = (torch.randn(1, local, heads, args.head_dim, device=demo.device, dtype=demo.dtype)
                   for heads in (args.n_heads, args.n_kv_heads, args.n_kv_heads))
        attend = partial(ring_attention, group=groups[rank // ring])
        measured = measure_stage_memory(attend, q.requires_grad_(), (k, v))
        planned = ring_attention_bytes(args, seq_len, ring, ring, torch.finfo(demo.dtype).bits // 8)
        rows.append((ring, f"{local:,}", measured, planned))
        del q, k, v
    if rank == 0:
        print(f"{demo.model} heads ({args.n_heads} query, {args.n_kv_heads} KV), {seq_len:,} "
              f"tokens, {demo.dtype}; one ring attention forward + backward; measured: "
              f"{measured_what(demo.on_gpu)}; planned: + ring buffers in flight "
              f"(support/byte_counts.py)")
        print_measured_and_planned(["ring R", "tokens/rank"], rows)
    end_ranks()


if __name__ == "__main__":
    main()
