"""02_ulysses.py: the all-to-all attention and the full model equal unsharded training."""

import importlib

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from reference import (GPU_HEAD_DIM, GPU_KERNELS, assert_matches, assert_step_matches,
                       assert_within_bf16_error, full, make_batch, reference_loss_and_grads,
                       train_loss_and_grads, with_kernel)

from base import kernels
import model as llama
from support.data import parse_tokens
from support.config import Config, resolve_techniques
from support.runtime import setup_runtime

ulysses = importlib.import_module("02_ulysses")
train = importlib.import_module("train")

# (query heads, KV heads) per world size: MHA, KV heads = P, KV heads < P, KV heads > P.
HEAD_CASES = {
    1: [(8, 8), (8, 2)],
    2: [(8, 8), (8, 2), (8, 1), (8, 4)],
    4: [(8, 8), (8, 4), (8, 2), (16, 8)],
}


def _attention_matches_unsharded(device="cpu", dtype=torch.float32, head_dim=16):
    """Each rank's output and q/k/v gradients (its tokens) against the fp32 unsharded attention:
    elementwise in fp32; in bf16 by the one bf16 rule (tests/reference.py), against one kernel
    call over the whole sequence in bf16."""
    rank, sp = dist.get_rank(), dist.get_world_size()
    batch, seq_len = 2, 32
    local = slice(rank * seq_len // sp, (rank + 1) * seq_len // sp)
    for n_heads, n_kv_heads in HEAD_CASES[sp]:
        g = torch.Generator().manual_seed(n_heads * 100 + n_kv_heads)
        q = torch.randn(batch, seq_len, n_heads, head_dim, generator=g)
        k, v = (torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=g) for _ in range(2))
        grad_out = torch.randn(batch, seq_len, n_heads, head_dim, generator=g)
        reference = _attention_results(q, k, v, grad_out, local)  # fp32, unsharded, on the CPU
        # Ulysses: each rank holds its token slice.
        mine = [t[:, local].to(device, dtype).requires_grad_() for t in (q, k, v)]
        shapes = []

        def kernel(q, k, v, *rest, **options):  # what the kernel is given: the head layout
            shapes.append(tuple(q.shape))
            return kernels.causal_attention(q, k, v, *rest, **options)

        out = ulysses.ulysses_attention(*mine, group=dist.group.WORLD, kernel=kernel)
        # the technique acts: all S tokens of H/P heads (an all-gather of everything computes
        # the same numbers from all heads)
        assert shapes == [(batch, seq_len, n_heads // sp, head_dim)], shapes
        out.backward(grad_out[:, local].to(device, dtype))
        got = {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", mine)}}
        what = f"P={sp} heads={n_heads} kv={n_kv_heads}"
        if dtype == torch.float32:
            for name, want in reference.items():
                torch.testing.assert_close(got[name].cpu(), want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{what} {name}: {m}")
        else:
            unsharded = _attention_results(*(t.to(device, dtype) for t in (q, k, v, grad_out)),
                                           local)
            assert_within_bf16_error(got, unsharded, reference, what)


def _attention_results(q, k, v, grad_out, local) -> dict:
    """One kernel call over the whole sequence: output and q/k/v gradients at `local` tokens."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernels.causal_attention(*leaves)
    out.backward(grad_out)
    return {"out": out.detach()[:, local], **{f"d{n}": t.grad[:, local]
                                              for n, t in zip("qkv", leaves)}}


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2,
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_attention_output_and_grads_equal_unsharded(world_size):
    run_ranks(world_size, _attention_matches_unsharded)


def _model_matches_unsharded(sp, ignore, device="cpu", dtype="float32", model="tiny"):
    cfg = Config(model=model, fsdp=True, ulysses=True, sp=sp, seq_len=32, device=device,
                 dtype=dtype, attn_kernel=kernels._requested["kernel"])
    dp = dist.get_world_size() // sp
    tokens, labels = make_batch(256, dp * 2, cfg.seq_len, seed=sp, ignore_frac=0.3 if ignore else 0)
    if ignore:
        labels[0, : cfg.seq_len // sp] = llama.IGNORE_INDEX  # rank 0's whole shard of row 0
        labels[-1, :] = llama.IGNORE_INDEX  # one whole sample (with dp > 1, one rank's row)
    cfg.batch_size = 2
    ref_loss, ref_grads = reference_loss_and_grads(model, tokens, labels)
    loss, grads = train_loss_and_grads(cfg, tokens, labels)
    assert_step_matches(loss.cpu(), grads, ref_loss, ref_grads, model, tokens, labels, dtype,
                        what=f"sp={sp} dp={dp} ignore={ignore}")


@pytest.mark.parametrize("world_size,sp,ignore", [
    (2, 2, False), pytest.param(4, 4, True, marks=pytest.mark.slow),
    pytest.param(4, 2, True, marks=pytest.mark.slow)])
def test_fsdp_ulysses_model_equals_single_process(world_size, sp, ignore):
    """Loss and every parameter gradient; (4, 2) is dp=2 x sp=2. The tiny preset has 2 KV heads,
    so sp=4 exercises KV-head replication."""
    run_ranks(world_size, _model_matches_unsharded, sp, ignore)


def _lesson_step_matches_unsharded():
    """02's own loss_and_backward (the step its docstring teaches; train.py's forward_backward
    adds packing and micro-batches around it) on the model train.py builds."""
    sp = dist.get_world_size()
    cfg = resolve_techniques(Config(model="tiny", fsdp=True, ulysses=True, sp=sp, seq_len=32,
                                    batch_size=2))
    tokens, labels = make_batch(256, 2, cfg.seq_len, seed=7, ignore_frac=0.3)
    labels[0, : cfg.seq_len // sp] = llama.IGNORE_INDEX  # rank 0 has fewer labels in row 0
    ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)
    rt = setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    loss = ulysses.loss_and_backward(model, tokens, rt.sp_rank, sp, dist.group.WORLD, labels)
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    assert_matches(loss, grads, ref_loss, ref_grads, what="02's loss_and_backward")


def test_lessons_loss_and_backward_equals_single_process():
    """The loss summed over ranks is the global mean, and the gradients are the unsharded
    model's: a rank dividing by its own count, or a loss left unsummed, fails here."""
    run_ranks(2, _lesson_step_matches_unsharded)


def test_shift_before_shard_keeps_boundary_labels():
    tokens = torch.arange(9)[None]  # S = 8
    pieces = [ulysses.shard_sequence(tokens, r, 2) for r in range(2)]
    assert pieces[0][1].tolist() == [[1, 2, 3, 4]]  # the label of token 3 is token 4, from shard 1
    assert pieces[1][0].tolist() == [[4, 5, 6, 7]] and pieces[1][1].tolist() == [[5, 6, 7, 8]]
    assert pieces[1][2].tolist() == [[4, 5, 6, 7]]  # global positions


@pytest.mark.parametrize("heads,kv,sp,needle", [
    (32, 8, 3, "query heads (32) to be divisible by the sequence-parallel degree (3)"),
    (12, 6, 4, "KV heads (6) to be divisible by the sequence-parallel degree (4)"),
    (24, 3, 4, "needs 4 to be divisible by 3"),
])
def test_bad_head_counts_are_refused(heads, kv, sp, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ulysses.check_ulysses_shapes(heads, kv, sp)


def test_length_not_divisible_is_refused():
    with pytest.raises(ValueError, match=r"sequence length \(10\) must be divisible .* \(4\)"):
        ulysses.shard_sequence(torch.zeros(1, 11, dtype=torch.long), 0, 4)
    with pytest.raises(ValueError, match=r"sequence length \(10\)"):
        ulysses.check_ulysses_shapes(8, 2, 2 * 2, seq_len=10)


def test_token_counts_parse():
    assert [parse_tokens(t) for t in ("4096", "128K", "3M", "1.5M")] == [
        4096, 131072, 3145728, 1572864]
    with pytest.raises(ValueError, match="cannot read a token count"):
        parse_tokens("lots")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_fsdp_ulysses_model_nccl_bf16_matches_fp32_reference(kernel):
    run_ranks(2, with_kernel, kernel, _model_matches_unsharded, 2, True, "cuda", "bfloat16",
              "tiny-hd64", backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_attention_nccl_bf16_matches_fp32_reference(kernel):
    run_ranks(2, with_kernel, kernel, _attention_matches_unsharded, "cuda", torch.bfloat16,
              GPU_HEAD_DIM, backend="nccl")


def test_kv_heads_replicated_adjacent_for_the_ranks_that_use_them():
    """Fewer KV heads than ranks: rank j's query heads use KV head j * n_kv // P, so copies of
    a KV head are adjacent (a tiled repeat would give rank 1 KV head 1's copy at P = 4, kv = 2)."""
    kv = torch.arange(2.0).view(1, 1, 2, 1)  # (B, S/P, Hkv = 2, D): head h holds h
    assert ulysses.replicate_kv_heads(kv, 4).flatten().tolist() == [0, 0, 1, 1]
    assert ulysses.replicate_kv_heads(kv, 2) is kv  # as many KV heads as ranks: untouched
