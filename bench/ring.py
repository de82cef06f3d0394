"""The peer we compare against: ring attention through PyTorch's own context parallelism
(`torch.distributed.tensor.experimental.context_parallel`), on our model with the same stack.

Not one of the techniques: bench/throughput.py times it next to Ulysses and Untied Ulysses, and
tests/test_peer_ring.py checks on two GPUs that it computes the same loss and gradients as the
unsharded model (torch's ring dispatches only the CUDA SDPA kernels, so there is no CPU test).

What the context manager does, and why our model needs no change for it:
  - it shards the buffers it is given (input ids, positions, labels) along the sequence with
    head-tail load balancing: the sequence is cut into 2P chunks and rank r keeps chunks r and
    2P-1-r, so every rank gets an equal share of the causal work;
  - it replaces F.scaled_dot_product_attention by a ring: each rank's K/V chunk travels around
    the ranks and partial outputs are merged with their log-sum-exp. Our attention core calls
    F.scaled_dot_product_attention (told to, `sdpa_only`, even where FlashAttention-4 is
    installed: the ring would not see an FA4 call and each rank would attend to its own chunk
    only), and positions travel with the tokens, so rotary phases stay right after the
    reordering.
The loss is the same global token mean as train.forward_backward's: every rank sums its tokens'
losses and divides by the count over the whole sequence (each rank holds the whole batch before
sharding, so the count needs no collective).
"""

import importlib
from functools import partial

import torch
import torch.distributed as dist

from base import kernels
from support import errors
from model import IGNORE_INDEX

train = importlib.import_module("train")


def context_parallel_mesh(device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dist.get_world_size(),), mesh_dim_names=("cp",))


def sdpa_attention(q, k, v, repeat_kv: bool = False, cu_seqlens=None):
    """The model's attention core on SDPA only; repeat_kv repeats K/V heads to the query heads
    before the kernel (what torchtitan does for its ring), for kernels or ring versions without
    grouped-query support. Packed documents are refused: torch's ring shards the sequence
    head-tail and sees only a causal SDPA call, with no way to mask at document boundaries."""
    if cu_seqlens is not None:
        raise ValueError("the ring-attention peer (torch's context_parallel) does not support "
                         "packed documents (cu_seqlens); use Ulysses (02) or Untied Ulysses (05)")
    if repeat_kv:
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    return kernels.causal_attention(q, k, v, sdpa_only=True)


def use_ring_attention(model, gqa: str = "native") -> None:
    """'native': SDPA with enable_gqa; 'repeat': K/V heads repeated first."""
    if gqa not in ("native", "repeat"):
        raise ValueError(f"gqa must be 'native' or 'repeat', got {gqa!r}")
    for block in model.layers:
        block.self_attn.core = partial(sdpa_attention, repeat_kv=gqa == "repeat")


def ring_forward_backward(model, tokens: torch.Tensor, rt, cp_mesh, labels=None) -> torch.Tensor:
    """train.forward_backward for the ring: loss (global token mean, detached) after backward,
    every rank given the same whole `tokens` (1, S + 1)."""
    from torch.distributed.tensor.experimental import context_parallel

    tokens = tokens.to(rt.device)
    # Own storage for each buffer: context_parallel resizes them in place to this rank's shard.
    input_ids = tokens[:, :-1].clone()
    labels = (tokens[:, 1:] if labels is None else labels.to(rt.device)).clone()
    positions = torch.arange(input_ids.shape[1], device=rt.device).expand_as(input_ids).clone()
    n_tokens = (labels != IGNORE_INDEX).sum().clamp(min=1)
    buffers = [input_ids, positions, labels]
    with context_parallel(cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1],
                          no_restore_buffers=set(buffers)):
        with errors.out_of_memory_names("forward"):
            loss = model(input_ids, positions, labels) / n_tokens
        with errors.out_of_memory_names("backward"):
            loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)  # every rank's share of the mean, added up
    return loss

