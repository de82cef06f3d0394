"""02 - DeepSpeed-Ulysses sequence parallelism: each GPU holds 1/P of the tokens.

The memory problem. After FSDP (01) the model state is 15 GiB per GPU, but every GPU still runs
the whole 3M-token sequence. One attention layer alone holds Q and its output (3 x 2^20 tokens x
32 heads x 128 x 2 bytes = 24 GiB each) plus K and V (6 GiB each), and backward keeps such
tensors for every layer: the Untied Ulysses paper's chart (arXiv 2602.21196) needs 7680 GiB of
attention activations per GPU; all that the 32 blocks save comes to 13,056 GiB (136 KiB per
token per layer: 03 itemizes it).

The idea. Shard the sequence: rank r of P holds tokens [r*S/P, (r+1)*S/P) through embeddings,
norms, MLPs and the loss, which are all per token. Attention is the one place tokens meet. There,
an all-to-all turns "my S/P tokens, all H heads" into "all S tokens, my H/P heads"; each rank runs
an ordinary attention kernel over the full sequence for its heads, and a second all-to-all turns
the output back into "my tokens, all heads". Heads are independent, so the result is exact.
Every activation shrinks by P: 7680 GiB / 8 = 960 GiB of attention, 13,056 / 8 = 1,632 GiB in
all, still too much (03 goes on).

What must be right:
  - the all-to-all is an autograd op: its backward is the inverse all-to-all;
  - grouped-query attention: query heads divide by P; KV heads >= P divide by P, KV heads < P are
    replicated so each rank holds the KV head its query heads use;
  - labels are shifted *before* the sequence is split (else each shard loses its last label);
  - the loss is the mean over the tokens of all ranks, so gradients equal the unsharded ones.
Packed documents need nothing new: after the first all-to-all every rank holds all S tokens in
their original order, so the documents' global boundaries (`cu_seqlens`) mean what they mean
unsharded, and positions and ignored labels are computed before the split, like the shift.

Run the demo (attention-stage bytes per rank, with and without Ulysses):

    torchrun --nproc-per-node 2 02_ulysses.py --seq-len 16K            # CPU/gloo or GPUs
    torchrun --nproc-per-node 2 02_ulysses.py --model llama3-8b --seq-len 128K   # on GPUs
"""

from functools import partial

import torch
import torch.distributed as dist
from einops import rearrange

from model import IGNORE_INDEX
from base import kernels

GiB = 2**30


# The attention core (the model's seam 1): exchange, attend over the whole sequence, exchange back.

def ulysses_attention(q, k, v, group, kernel=kernels.causal_attention, cu_seqlens=None):
    """Local q (B, S/P, H, D), k/v (B, S/P, Hkv, D) -> local output (B, S/P, H, D).

    Rank r's query heads [r*H/P, (r+1)*H/P) use KV heads [r*Hkv/P, (r+1)*Hkv/P) when Hkv >= P
    (grouped-query order is preserved by the contiguous split), or the one replicated KV head.
    cu_seqlens: packed documents' boundaries, global offsets: they hold as they are after the
    exchange, which gives every rank all tokens in their original order.
    """
    sp = dist.get_world_size(group)
    k, v = replicate_kv_heads(k, sp), replicate_kv_heads(v, sp)
    q, k, v = seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group)
    # the full sequence, H/P heads: any kernel, unchanged
    out = kernel(q, k, v) if cu_seqlens is None else kernel(q, k, v, cu_seqlens=cu_seqlens)
    return heads_to_seq(out, group)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S/P, H, D) on each rank -> (B, S, H/P, D): all tokens, this rank's heads."""
    return AllToAll.apply(x, group, TO_HEADS)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """(B, S, H/P, D) -> (B, S/P, H, D): back to this rank's tokens, all heads."""
    return AllToAll.apply(x, group, TO_TOKENS)


def replicate_kv_heads(kv: torch.Tensor, sp: int) -> torch.Tensor:
    """With fewer KV heads than ranks, copy each KV head sp // n_kv times (adjacent), so the
    j-th of the sp heads sent away is the one rank j's query heads use. Backward sums copies."""
    n_kv_heads = kv.shape[2]  # (B, S/P, Hkv, D)
    if n_kv_heads >= sp:
        return kv
    return kv.repeat_interleave(sp // n_kv_heads, dim=2)


# One exchange, as two einops patterns: how to cut x into P pieces (p first: piece j goes to
# rank j), and how to join the P pieces that arrive (p: the rank each came from).
TO_HEADS = ("b s (p h) d -> p b s h d",   # my tokens, every rank's heads: cut the heads
            "p b s h d -> b (p s) h d")   # rank j's tokens come j-th: all tokens, my heads
TO_TOKENS = ("b (p s) h d -> p b s h d",  # the inverse: cut the tokens,
             "p b s h d -> b s (p h) d")  # join the heads in rank order
INVERSE = {TO_HEADS: TO_TOKENS, TO_TOKENS: TO_HEADS}


def all_to_all(x: torch.Tensor, group, patterns) -> torch.Tensor:
    """Send piece j of x to rank j and join what arrives, as `patterns` (TO_HEADS or TO_TOKENS)
    say. Not differentiable by itself: see `AllToAll`."""
    world = dist.get_world_size(group)
    if world == 1:
        return x
    cut, join = patterns
    send = rearrange(x, cut, p=world).contiguous()  # all_to_all_single sends dim 0 in P parts
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return rearrange(received, join)


class AllToAll(torch.autograd.Function):
    """all_to_all with autograd: the gradient goes back through the inverse exchange."""

    @staticmethod
    def forward(ctx, x, group, patterns):
        ctx.group, ctx.patterns = group, patterns
        return all_to_all(x, group, patterns)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad.contiguous(), ctx.group, INVERSE[ctx.patterns]), None, None


# Data: shift, then shard; the loss as a global token mean.

def shard_sequence(tokens: torch.Tensor, sp_rank: int, sp: int, labels=None, positions=None,
                   order=None):
    """tokens (B, S+1) -> this rank's (input_ids, labels, position_ids), each (B, S/P).

    The labels are the inputs shifted by one *before* the split: the last input of shard r is
    predicted from the first token of shard r+1, which only the unsplit tensor still has.
    Labels given explicitly (B, S), e.g. with -100 where ignored, are split the same way, and
    so are positions (B, S) given explicitly (packed documents: restarting at each document).
    order: a permutation of the S positions applied before the split (06's ring wants its
    zigzag layout); positions travel with their tokens, so rotary and the loss are unchanged.
    """
    seq_len = tokens.shape[1] - 1
    check_sequence_split(seq_len, sp)
    local_seq_len = seq_len // sp
    local = slice(sp_rank * local_seq_len, (sp_rank + 1) * local_seq_len)
    input_ids = tokens[:, :-1]
    labels = tokens[:, 1:] if labels is None else labels
    if positions is None:
        positions = torch.arange(seq_len, device=tokens.device).expand(tokens.shape[0], -1)
    if order is not None:
        local = order.to(tokens.device)[local]
    return input_ids[:, local], labels[:, local], positions[:, local]


def global_token_count(labels: torch.Tensor, group=None) -> torch.Tensor:
    """Number of non-ignored labels over all ranks of `group` (None: this process alone).

    Each rank divides its summed loss by this, so the ranks' losses add up to the global mean
    and their gradients add up (FSDP sums them) to the unsharded model's gradient.
    """
    count = (labels != IGNORE_INDEX).sum().to(torch.float32)
    if group is not None:
        dist.all_reduce(count, group=group)
    return count.clamp(min=1.0)  # all labels ignored: loss 0, not NaN


def loss_and_backward(model, tokens, sp_rank: int, sp: int, world_group=None,
                      labels=None) -> torch.Tensor:
    """One forward + backward on this rank's shard of `tokens` (B, S + 1); returns the loss,
    the mean over the non-ignored labels of every rank in `world_group` (detached, summed over
    ranks). Each rank divides its summed loss by the global count, so the ranks' gradients add
    up (FSDP sums them) to the unsharded model's. train.py's forward_backward is this step with
    packed documents, micro-batches and 06's token order."""
    input_ids, labels, positions = shard_sequence(tokens, sp_rank, sp, labels)
    n_tokens = global_token_count(labels, world_group)
    loss = model(input_ids, positions, labels) / n_tokens
    loss.backward()
    loss = loss.detach()
    if world_group is not None:
        dist.all_reduce(loss, group=world_group)  # every rank's share of the mean, added up
    return loss


# Applying it: every attention layer's core.

def apply_ulysses(model, group) -> None:
    """Make every attention layer of `model` sequence-parallel over `group`: its own kernel (seam
    1 as it finds it) runs between the two exchanges, over all tokens of this rank's heads."""
    args = model.args
    check_ulysses_shapes(args.n_heads, args.n_kv_heads, dist.get_world_size(group))
    for block in model.layers:
        block.self_attn.core = partial(ulysses_attention, group=group, kernel=block.self_attn.core)


# ---- below: checks, demo -------------------------------------------------------------------------

# The checks, before any work.

def check_ulysses_shapes(n_heads: int, n_kv_heads: int, sp: int, seq_len: int | None = None):
    """Raise ValueError naming the numbers when Ulysses cannot split this model over `sp` ranks."""
    if n_heads % sp:
        raise ValueError(f"Ulysses needs the query heads ({n_heads}) to be divisible by the "
                         f"sequence-parallel degree ({sp})")
    if n_kv_heads >= sp and n_kv_heads % sp:
        raise ValueError(f"Ulysses needs the KV heads ({n_kv_heads}) to be divisible by the "
                         f"sequence-parallel degree ({sp}) when there are at least as many")
    if n_kv_heads < sp and sp % n_kv_heads:
        raise ValueError(f"Ulysses replicates the KV heads ({n_kv_heads}) when there are fewer "
                         f"than sequence-parallel ranks ({sp}); that needs {sp} to be divisible "
                         f"by {n_kv_heads}")
    if seq_len is not None:
        check_sequence_split(seq_len, sp)


def check_sequence_split(seq_len: int, sp: int, ring: int = 1) -> None:
    """The one rule for cutting a sequence over `sp` ranks (every file that shards calls this);
    with a ring of R (06) the sequence is also cut into 2R equal zigzag chunks."""
    if seq_len % sp:
        raise ValueError(f"the sequence length ({seq_len}) must be divisible by the "
                         f"sequence-parallel degree ({sp}) so every rank gets the same tokens")
    if ring > 1 and seq_len % (2 * ring):
        raise ValueError(f"the sequence length ({seq_len}) must be divisible by 2R = {2 * ring}: "
                         f"the ring's zigzag layout cuts it into 2R equal chunks")


def check_data_sequence_layout(world: int, sp: int) -> None:
    """The ranks as data-parallel groups of `sp` sequence-parallel ranks: sp divides them."""
    if sp < 1 or world % sp:
        raise ValueError(f"--sp ({sp}) must divide the number of ranks ({world})")


def main():
    from support.demos import attention_demo_setup, attention_input, end_ranks, measure_stage_memory

    demo = attention_demo_setup("02_ulysses.py")
    check_ulysses_shapes(demo.args.n_heads, demo.args.n_kv_heads, demo.sp, demo.seq_len)
    attn, dtype = demo.attn, demo.dtype
    measured = {}
    for name, tokens in (("without Ulysses (all tokens)", demo.seq_len),
                         ("with Ulysses", demo.seq_len // demo.sp)):
        if name == "with Ulysses":
            attn.core = partial(ulysses_attention, group=dist.group.WORLD)
        x, rope = attention_input(demo, tokens, sharded=name == "with Ulysses")
        measured[name] = measure_stage_memory(attn.attend, x, (rope,))
        del x
    if demo.rank == 0:
        how = "peak allocated (GPU)" if demo.on_gpu else "saved-for-backward + output bytes (CPU)"
        print(f"{demo.model}, {demo.seq_len:,} tokens, {demo.sp} ranks, {dtype}; one attention "
              f"layer, {how}")
        for name, nbytes in measured.items():
            print(f"  {name:<30} {nbytes / GiB:10.3f} GiB per rank")
    end_ranks()


if __name__ == "__main__":
    main()
