"""05_untied_ulysses.py: headwise stages compute exactly what Ulysses and unsharded attention
compute, keep less memory alive, and never re-run attention forward in backward."""

import gc
import importlib
import importlib.util
import subprocess
import sys
import weakref
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from reference import (GPU_HEAD_DIM, GPU_KERNELS, assert_matches, assert_within_bf16_error,
                       make_batch, plain_attention_results, reference_loss_and_grads,
                       relative_error, train_loss_and_grads, with_kernel)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from base import kernels
from support import byte_counts
import model as llama
from support.config import Config

untied = importlib.import_module("05_untied_ulysses")
ulysses = importlib.import_module("02_ulysses")
train = importlib.import_module("train")
REPO = Path(__file__).resolve().parent.parent

# (query heads, KV heads) per world size: MHA, KV heads = P, KV heads < P, KV heads > P.
HEAD_CASES = {
    1: [(8, 8), (8, 1), (8, 2)],
    2: [(8, 8), (8, 2), (8, 1), (8, 4)],
    4: [(8, 8), (8, 4), (8, 2), (16, 8)],
}


def small_args(n_heads, n_kv_heads, qk_norm, dim=32, head_dim=8):
    return llama.ModelArgs(dim=dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                           head_dim=head_dim, ffn_dim=64, vocab_size=64, qk_norm=qk_norm)


def random_attention(args, seed):
    """An Attention layer with random weights, QK-norm weights included (not all ones)."""
    torch.manual_seed(seed)
    attn = llama.Attention(args)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.3 if p.dim() == 1 else 0.1)
    return attn


def chunks_to_test(n_heads, n_kv_heads, sp):
    """U in {P, 2P, H} where valid (2P can break the KV-group rule or exceed H)."""
    chunks = []
    for chunk in (sp, 2 * sp, n_heads):
        try:
            if untied.check_head_chunk(n_heads, n_kv_heads, sp, chunk) not in chunks:
                chunks.append(chunk)
        except ValueError:
            pass
    return chunks


def assert_close_for(got, want, rtol, msg):
    """The relative error of the whole tensor, ||got - want|| / ||want||, below rtol (fp32).

    Not elementwise: the stages and ranks add the same terms in another order, so an element
    that is itself a near-cancelling sum keeps only rounding noise (fp32: a dK entry off by 3e-5
    relative was seen with torch 2.14, the tensor's relative error ~1e-7). A wrong head, stage,
    scale or missing term moves the whole tensor by far more than rtol (1e-5)."""
    error = relative_error(got, want)
    assert error < rtol, msg(f"relative error {error:.2e} >= {rtol}")


def run_attend(attend, x, rope, grad_out, attn):
    """Output, input gradient and every projection/QK-norm weight gradient of one call."""
    x = x.detach().clone().requires_grad_()
    attn.zero_grad(set_to_none=True)
    out = attend(x, rope)
    out.backward(grad_out)
    grads = {n: p.grad.clone() for n, p in attn.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, grads


# ---------------------------------------------------------------------------------------------
# The attention sub-layer: equal to the unsharded layer and to plain Ulysses.
# ---------------------------------------------------------------------------------------------

def _layer_matches(device="cpu", dtype=torch.float32, head_dim=8, head_cases=None):
    """Each rank's output and input gradient (its tokens) and every weight gradient (summed over
    the ranks) against the unsharded fp32 layer; in fp32 also equal to plain Ulysses on the same
    rank. In bf16 by the one bf16 rule (tests/reference.py), whose unsharded run is the layer
    over the whole sequence in one process. head_cases: (query heads, KV heads) pairs, default
    HEAD_CASES of this world size."""
    rank, sp = dist.get_rank(), dist.get_world_size()
    head_cases = HEAD_CASES[sp] if head_cases is None else head_cases
    group = dist.group.WORLD
    batch, seq_len = 2, 32
    local = slice(rank * seq_len // sp, (rank + 1) * seq_len // sp)
    checked = 0
    for n_heads, n_kv_heads in head_cases:
        for qk_norm in (False, True):
            args = small_args(n_heads, n_kv_heads, qk_norm, head_dim=head_dim)
            attn = random_attention(args, seed=n_heads * 10 + n_kv_heads + qk_norm)
            g = torch.Generator().manual_seed(n_heads + n_kv_heads)
            x = torch.randn(batch, seq_len, args.dim, generator=g)
            grad_out = torch.randn(batch, seq_len, n_heads * args.head_dim, generator=g)
            positions = torch.arange(seq_len).expand(batch, -1)

            def whole_sequence(on_device: bool) -> dict:  # unsharded, one process
                here = (random_attention(args, 0).to(device, dtype) if on_device else attn)
                here.load_state_dict(attn.state_dict())
                to = (lambda t: t.to(device, dtype)) if on_device else (lambda t: t)  # noqa: E731
                rope = llama.rope_cos_sin(to(positions), args, dtype if on_device else x.dtype)
                out, dx, grads = run_attend(here.attend, to(x), rope, to(grad_out), here)
                return layer_results(out[:, local], dx[:, local], grads)

            reference = whole_sequence(on_device=False)  # fp32 on the CPU
            unsharded = whole_sequence(on_device=True) if dtype != torch.float32 else None
            # This rank's tokens on the device, for plain Ulysses and for every chunk size.
            attn_here = random_attention(args, 0).to(device, dtype)
            attn_here.load_state_dict(attn.state_dict())
            rope = llama.rope_cos_sin(positions[:, local].to(device), args, dtype)
            x_here, grad_here = x[:, local].to(device, dtype), grad_out[:, local].to(device, dtype)
            attn_here.core = partial(ulysses.ulysses_attention, group=group)
            uly = run_attend(attn_here.attend, x_here, rope, grad_here, attn_here)
            for chunk in chunks_to_test(n_heads, n_kv_heads, sp):
                attend = partial(untied.untied_attend, attn=attn_here, group=group,
                                 head_chunk=chunk)
                out, dx, grads = run_attend(attend, x_here, rope, grad_here, attn_here)
                what = (f"P={sp} heads={n_heads} kv={n_kv_heads} qk_norm={qk_norm} U={chunk}")
                assert grads.keys() == uly[2].keys(), what
                summed = {}
                for name, grad in grads.items():
                    summed[name] = grad.float().clone()
                    dist.all_reduce(summed[name])  # each rank holds its tokens' share (FSDP sums)
                got = layer_results(out, dx, summed)
                if unsharded is not None:
                    assert_within_bf16_error(got, unsharded, reference, what)
                    checked += 1
                    continue
                close = partial(assert_close_for, rtol=1e-5)
                for name, want in reference.items():
                    close(got[name].cpu(), want, msg=lambda m: f"{what} {name}: {m}")
                # Plain Ulysses on the same rank: the same output and the same partial grads.
                close(out, uly[0], msg=lambda m: f"{what} out vs Ulysses: {m}")
                close(dx, uly[1], msg=lambda m: f"{what} dx vs Ulysses: {m}")
                for name, grad in grads.items():
                    close(grad, uly[2][name], msg=lambda m: f"{what} d{name} vs Ulysses: {m}")
                checked += 1
    assert checked >= 4 * len(head_cases)


def layer_results(out, dx, grads: dict) -> dict:
    return {"out": out, "dx": dx, **{f"d{name}": grad for name, grad in grads.items()}}


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2,
                                        pytest.param(4, marks=pytest.mark.slow)])
def test_attention_layer_equals_unsharded_and_ulysses(world_size):
    """MHA and GQA with KV heads = P, < P, > P; with and without QK-norm; U in {P, 2P, H}."""
    run_ranks(world_size, _layer_matches)


# ---------------------------------------------------------------------------------------------
# The full model with the whole stack.
# ---------------------------------------------------------------------------------------------

def _model_matches(sp, chunks):
    dp = dist.get_world_size() // sp
    for chunk in chunks:
        cfg = Config(model="tiny", sp=sp, head_chunk=chunk, seq_len=32, batch_size=2,
                     stack=5)
        tokens, labels = make_batch(256, dp * 2, cfg.seq_len, seed=sp + chunk, ignore_frac=0.3)
        labels[-1, :] = llama.IGNORE_INDEX  # one whole sample ignored
        ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)
        loss, grads = train_loss_and_grads(cfg, tokens, labels)
        assert_matches(loss, grads, ref_loss, ref_grads, what=f"sp={sp} dp={dp} U={chunk}")


@pytest.mark.parametrize("world_size,sp,chunks", [
    (2, 2, (2, 8)), pytest.param(4, 4, (4, 8), marks=pytest.mark.slow),
    pytest.param(4, 2, (2,), marks=pytest.mark.slow)])
def test_full_stack_model_equals_single_process(world_size, sp, chunks):
    """Loss and every parameter gradient. tiny has 8 query and 2 KV heads: at sp=2 KV heads = P
    (U=2 runs 4 stages per KV group), at sp=4 they are replicated; (4, 2) is dp=2 x sp=2."""
    run_ranks(world_size, _model_matches, sp, chunks)


# ---------------------------------------------------------------------------------------------
# Chunk sizes that cannot work are refused.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,kv,sp,chunk,needle", [
    (32, 8, 2, 3, "head chunk U (3) to be a positive multiple of the sequence-parallel degree (2)"),
    (32, 8, 4, 0, "head chunk U (0) to be a positive multiple"),
    (32, 8, 2, 12, "head chunk U (12) to divide the query heads (32)"),
    (24, 6, 2, 12, "(U/P = 12/2 = 6) to divide, or be a multiple of, the query heads per KV head "
                   "(24/6 = 4)"),
    (32, 8, 3, 3, "query heads (32) to be divisible by the sequence-parallel degree (3)"),
])
def test_bad_chunks_are_refused(heads, kv, sp, chunk, needle):
    with pytest.raises(ValueError) as error:
        untied.check_head_chunk(heads, kv, sp, chunk)
    assert needle in str(error.value)


def test_default_chunk_is_the_degree():
    assert untied.check_head_chunk(32, 8, 8, None) == 8
    assert untied.check_head_chunk(8, 2, 4, None) == 4


@pytest.mark.slow
def test_train_refuses_bad_chunk():
    result = subprocess.run([sys.executable, "train.py", "--untied", "--head-chunk", "3",
                             "--steps", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "head chunk U (3) to divide the query heads (8)" in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------
# The technique acts: less memory alive, buffers reused across stages, no attention re-run.
# ---------------------------------------------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """A CPU stand-in for the GPU allocator's statistics: bytes of the storages created by ops
    inside the mode that are still referenced by a tensor, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages = {}  # data_ptr -> [tensors alive, nbytes]
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(func)
        outside = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor)} - self.storages.keys()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or ptr in outside:  # in place on, or a view of, an outside tensor
                continue
            if ptr not in self.storages:
                self.storages[ptr] = [0, nbytes]
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            self.storages[ptr][0] += 1
            weakref.finalize(t, self._release, ptr)
        return out

    def _release(self, ptr):
        entry = self.storages.get(ptr)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.storages[ptr]


def attention_stage_memory(attend, x, rope, grad_out, params):
    """(peak live bytes during forward + backward, bytes saved for backward) of one call; the
    saved bytes exclude the inputs and the weights, which exist anyway."""
    exclude = {t.untyped_storage().data_ptr() for t in (x, *rope, *params)}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    # Tensors are counted until their Python objects die; the cyclic garbage collector running
    # at a random allocation inside one measurement but not another would move the peak.
    gc.collect()
    gc.disable()
    try:
        tracker = LiveBytes()
        with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attend(x, rope)
        with tracker:
            out.backward(grad_out)
    finally:
        gc.enable()
    return tracker.peak, sum(saved.values())


def _memory_shrinks_and_does_not_grow_with_stages():
    rank, sp = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    batch, local_seq_len, dim, head_dim = 1, 256, 64, 16
    positions = torch.arange(rank * local_seq_len, (rank + 1) * local_seq_len)[None]
    x = torch.randn(batch, local_seq_len, dim, requires_grad=True)

    def measure(n_heads, chunk, ulysses_core=False):
        args = small_args(n_heads, 4, qk_norm=True, dim=dim, head_dim=head_dim)
        attn = random_attention(args, 0)
        rope = llama.rope_cos_sin(positions, args, torch.float32)
        grad_out = torch.randn(batch, local_seq_len, n_heads * head_dim)
        if ulysses_core:
            attn.core = partial(ulysses.ulysses_attention, group=group)
            attend = attn.attend
        else:
            attend = partial(untied.untied_attend, attn=attn, group=group, head_chunk=chunk)
        x_here = x.detach().clone().requires_grad_()  # every measurement starts alike
        attend(x_here, rope).sum().backward()  # warm-up: the first call checks the kernel once
        x_here.grad = None
        attn.zero_grad(set_to_none=True)
        return attention_stage_memory(attend, x_here, rope, grad_out, list(attn.parameters()))

    # 1. At U = P, 4, 8 and 16 stages (8, 16, 32 query heads): what is alive beyond the buffers
    # that grow with the heads by design - the output, its lse and the q_proj weight gradient -
    # is the same: one stage's working memory, reused.
    residual = {}
    for n_heads in (8, 16, 32):
        peak, saved = measure(n_heads, sp)
        by_design = 4 * n_heads * (batch * local_seq_len * (head_dim + 1) + head_dim * dim)
        residual[n_heads] = peak - by_design
    # (The CPU byte tracker is exact only to about one x-sized tensor: storages are matched by
    # address and released when their Python objects die. Keeping one stage's q alive per stage
    # would add 12 x 32 KiB from 4 to 16 stages, far above this bound.)
    x_bytes = batch * local_seq_len * dim * 4
    assert max(residual.values()) - min(residual.values()) <= 2 * x_bytes, residual

    # 2. 16 query heads: smaller chunks, smaller peak; the saved bytes never depend on U.
    measured = {chunk: measure(16, chunk) for chunk in (sp, 2 * sp, 16)}
    ulysses_peak, ulysses_saved = measure(16, None, ulysses_core=True)
    (peak_p, saved_p), (peak_2p, saved_2p), (peak_h, saved_h) = measured.values()
    report = f"untied {measured}, Ulysses {(ulysses_peak, ulysses_saved)}"
    output_bytes = batch * local_seq_len * 16 * head_dim * 4
    lse_bytes = batch * (16 // sp) * (sp * local_seq_len) * 4  # fp32, this rank's heads, all tokens
    assert saved_p == saved_2p == saved_h == output_bytes + lse_bytes, report
    assert saved_p < ulysses_saved / 2, report
    assert peak_p < peak_2p < peak_h, report
    assert peak_p < ulysses_peak * 0.5, report  # the GPU target, on the CPU stand-in


@pytest.mark.slow
def test_memory_shrinks_with_smaller_chunks_and_is_below_ulysses():
    run_ranks(2, _memory_shrinks_and_does_not_grow_with_stages)


def test_backward_runs_attention_backward_only(monkeypatch):
    """Backward uses the saved log-sum-exp: no attention forward, one backward per stage."""
    args = small_args(8, 2, qk_norm=False)
    attn = random_attention(args, 0)
    calls = {"forward": 0, "backward": 0}
    forward, backward = kernels.attention_forward_lse, kernels.attention_backward_lse

    def count(name, fn, *a, **k):
        calls[name] += 1
        return fn(*a, **k)

    monkeypatch.setattr(kernels, "attention_forward_lse", partial(count, "forward", forward))
    monkeypatch.setattr(kernels, "attention_backward_lse", partial(count, "backward", backward))
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    rope = llama.rope_cos_sin(torch.arange(16).expand(2, -1), args, torch.float32)
    out = untied.untied_attend(x, rope, attn, None, head_chunk=2)
    assert calls == {"forward": 4, "backward": 0}
    tracker = LiveBytes()
    with tracker:
        out.sum().backward()
    assert calls == {"forward": 4, "backward": 4}
    names = [str(op) for op in tracker.ops]
    assert not any("flash_attention_for_cpu.default" in n or "scaled_dot_product_attention" in n
                   for n in names), names
    assert sum("flash_attention_for_cpu_backward" in n for n in names) == 4


# ---------------------------------------------------------------------------------------------
# The kernel wrapper, and the byte count for the planner.
# ---------------------------------------------------------------------------------------------

def check_kernel_wrapper(device, dtype, kernels_to_check=None):
    """The log-sum-exp pair of each kernel against SDPA in fp32: elementwise in fp32; in bf16 by
    the one bf16 rule (tests/reference.py), against SDPA's own bf16 call."""
    for n_heads, n_kv_heads in [(4, 4), (4, 2), (4, 1)]:
        g = torch.Generator().manual_seed(n_heads * 10 + n_kv_heads)
        shape = (2, 48, n_heads, 64)
        q, grad_out = (torch.randn(shape, generator=g) for _ in range(2))
        k, v = (torch.randn(2, 48, n_kv_heads, 64, generator=g) for _ in range(2))
        reference = dict(zip(("out", "dq", "dk", "dv"), plain_attention_results(q, k, v, grad_out)))
        args = [t.to(device, dtype) for t in (q, k, v)]
        plain = (None if dtype == torch.float32
                 else plain_attention_results(*args, grad_out.to(device, dtype)))
        unsharded = None if plain is None else dict(zip(reference, plain))
        for kernel in kernels_to_check or [None, "math"] + (["flash"] if device == "cuda" else []):
            out, lse = kernels.attention_forward_lse(*args, kernel=kernel)
            grads = kernels.attention_backward_lse(grad_out.to(device, dtype), *args, out, lse,
                                                  kernel=kernel)
            what = f"{kernels.lse_kernel(args[0], kernel)} heads={n_heads} kv={n_kv_heads}"
            assert lse.dtype == torch.float32, what
            got = dict(zip(reference, (out, *grads)))
            for name, want in reference.items():
                assert got[name].shape == want.shape, what
            if unsharded is not None:
                assert_within_bf16_error(got, unsharded, reference, what)
                continue
            for name, want in reference.items():
                torch.testing.assert_close(got[name].cpu(), want, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "cpu"])
def test_private_op_calls_fit_this_torch(kernel):
    """The GPU branches' argument lists against this torch's op schemas, on meta tensors (no
    GPU needed): output and lse shapes, and gradients shaped like q, k, v with fewer KV heads."""
    q = torch.empty(1, 64, 4, 128, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 64, 2, 128, device="meta", dtype=torch.bfloat16)
    out, lse = kernels._forward(kernel, q, k, k)
    assert out.shape == (1, 64, 4, 128) and lse.dtype == torch.float32
    assert lse.shape[:3] == (1, 4, 64) and lse.numel() == 4 * 64
    grads = kernels._backward(kernel, out, q, k, k, out, lse)
    assert [tuple(g.shape) for g in grads] == [(1, 64, 4, 128), (1, 64, 2, 128), (1, 64, 2, 128)]


def test_kernel_wrapper_matches_sdpa():
    check_kernel_wrapper("cpu", torch.float32)


def test_kernel_wrapper_repeats_kv_heads_for_kernels_without_gqa(monkeypatch):
    """The fallback for a kernel that needs as many KV heads as query heads (older torch)."""
    monkeypatch.setitem(kernels._KERNEL_CHOICE, ("cpu", torch.float32, 64, "auto"), ("cpu", False))
    check_kernel_wrapper("cpu", torch.float32)


def test_planner_bytes():
    args = llama.get_model_args("llama3-8b")
    seq_len, sp = 3 * 2**20, 8
    ulysses_bytes = byte_counts.attention_activation_bytes(args, seq_len, sp)
    per_chunk = [byte_counts.untied_attention_bytes(args, seq_len, sp, chunk)
                 for chunk in (8, 16, 32)]
    assert per_chunk == sorted(per_chunk)
    assert per_chunk[0] < 0.65 * ulysses_bytes
    assert byte_counts.untied_attention_bytes(args, seq_len, sp, 8, saved_only=True) == (
        seq_len // sp * (32 * 128 * 2 + 32 * 4))  # the output buffer and every stage's lse
    # tiny by hand, U = P = 2 (one query head per rank per stage, 4 stages per KV head),
    # 16 local tokens, fp32: what the forward keeps, the gradient buffers, one stage.
    tiny = llama.get_model_args("tiny")
    saved = 16 * 8 * 8 * 4 + 16 * 8 * 4  # output (8 heads x 8 dims), lse (8 heads)
    gradients = 16 * 64 * 4 + (8 + 2 * 2) * 8 * 64 * 4  # grad x, grads of wq, wk, wv
    per_stage_tensor = 16 * 2 * 8 * 4  # one head per rank: q, out, k, ... in the head layout
    # k, v; q, out, grad out; dq, dk, dv; K/V gradients summed over the stages of the group
    stage = (2 + 3 + 3 + 2) * per_stage_tensor
    workspace = 32 * 1 * 8 * 4 + 32 * 1 * 4  # fp32 dq over 32 tokens, 1 head; dO*O row sums
    assert (byte_counts.untied_attention_bytes(tiny, 32, 2, 2, 4)
            == saved + gradients + stage + workspace)


# ---------------------------------------------------------------------------------------------
# GPUs (NCCL, bf16 against the fp32 CPU reference)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_kernel_wrapper_matches_sdpa_cuda(kernel):
    """The forced kernel's log-sum-exp pair, and the dense causal_attention, against SDPA fp32."""
    check_kernel_wrapper("cuda", torch.bfloat16, kernels_to_check=[kernel])
    kernels.use_kernel(kernel)
    try:
        g = torch.Generator().manual_seed(0)
        q, grad_out = (torch.randn(2, 256, 8, 128, generator=g) for _ in range(2))
        k, v = (torch.randn(2, 256, 2, 128, generator=g) for _ in range(2))
        names = ("out", "dq", "dk", "dv")
        reference = dict(zip(names, plain_attention_results(q, k, v, grad_out)))
        on_gpu = [t.cuda().bfloat16() for t in (q, k, v, grad_out)]
        unsharded = dict(zip(names, plain_attention_results(*on_gpu)))
        mine = [t.clone().requires_grad_() for t in on_gpu[:3]]
        out = kernels.causal_attention(*mine)
        out.backward(on_gpu[3])
        assert kernels.lse_kernel(mine[0])[0] == kernel
        got = dict(zip(names, (out.detach(), *(t.grad for t in mine))))
        assert_within_bf16_error(got, unsharded, reference, f"{kernel} causal_attention")
    finally:
        kernels.use_kernel("auto")


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_attention_layer_nccl_bf16_matches_fp32_reference(kernel):
    # FlashAttention-4 compiles a kernel per head layout and chunk size in each rank (seconds
    # each): with it, the two layouts where KV heads are shared across stages (GQA, MQA).
    cases = [(8, 2), (8, 1)] if kernel == "fa4" else None
    run_ranks(2, with_kernel, kernel, _layer_matches, "cuda", torch.bfloat16, GPU_HEAD_DIM, cases,
              backend="nccl")


def test_the_head_chunk_sets_the_stages_a_layer_runs(monkeypatch):
    """apply_untied_ulysses with U: each layer's forward runs the kernel once per stage, H/U
    times (one process, P = 1); a model that ignored U computes the same numbers."""
    args = llama.get_model_args("tiny")
    calls = []
    forward_lse = kernels.attention_forward_lse

    def counted(*a, **k):
        calls.append(1)
        return forward_lse(*a, **k)

    monkeypatch.setattr(kernels, "attention_forward_lse", counted)
    tokens = torch.randint(0, args.vocab_size, (1, 16))
    for head_chunk in untied.valid_head_chunks(args, 1):
        model = llama.Transformer(args)
        untied.apply_untied_ulysses(model, None, head_chunk=head_chunk)
        calls.clear()
        model(tokens, torch.arange(16)[None])
        assert len(calls) == args.n_layers * args.n_heads // head_chunk, (head_chunk, calls)


def test_kv_projected_once_per_kv_group(monkeypatch):
    """8 query heads, 2 KV heads, P = 1, U = 1: 8 stages in 2 KV groups of 4. The forward
    projects 8 Q + 2 K + 2 V (K and V once per group; once per stage would be 24); the backward
    recomputes the same 12, and QK-norm's input (8 Q, 2 K)."""
    assert [(kv, len(stages)) for kv, stages in untied.kv_groups(untied.stage_plan(8, 2, 1, 1))] \
        == [(slice(0, 1), 4), (slice(1, 2), 4)]
    args = small_args(8, 2, qk_norm=True)
    attn = random_attention(args, 0)
    rows_seen = []
    project = untied.project

    def counted(x, rows, head_dim):
        rows_seen.append(rows.shape[0] // head_dim)
        return project(x, rows, head_dim)

    monkeypatch.setattr(untied, "project", counted)
    x = torch.randn(2, 16, args.dim, requires_grad=True)
    rope = llama.rope_cos_sin(torch.arange(16).expand(2, -1), args, torch.float32)
    out = untied.untied_attend(x, rope, attn, None, head_chunk=1)
    forward = len(rows_seen)
    assert forward == 8 + 2 + 2, rows_seen  # 8 Q, then K and V once per KV group
    out.sum().backward()
    # backward: the same 12, plus QK-norm's recompute of its input (8 Q, 2 K)
    assert len(rows_seen) - forward == 12 + 8 + 2, rows_seen


def test_previous_kv_group_freed_before_the_next(monkeypatch):
    """The previous KV group's K and V are freed before the next group's K is projected, in the
    forward and in the backward (which projects them again): the bytes alive when each group's
    K projection starts change by less than a K (the forward keeps the lse of the stages run
    since, 1/64 of a K here), never by a group's K and V."""
    batch, seq_len, head_dim = 1, 128, 64
    k_bytes = batch * seq_len * head_dim * 4
    args = small_args(8, 4, qk_norm=False, dim=16, head_dim=head_dim)  # 4 KV groups of 2 stages
    attn = random_attention(args, 0)
    x = torch.randn(batch, seq_len, args.dim, requires_grad=True)
    rope = llama.rope_cos_sin(torch.arange(seq_len)[None], args, torch.float32)
    untied.untied_attend(x, rope, attn, None, head_chunk=1).sum().backward()  # warm-up
    tracker, live_at_k = LiveBytes(), []
    wk = attn.k_proj.weight.untyped_storage().data_ptr()
    project = untied.project

    def recorded(x, rows, head_dim):
        if rows.untyped_storage().data_ptr() == wk:  # P = 1: K's rows are views of wk
            live_at_k.append(tracker.live)
        return project(x, rows, head_dim)

    monkeypatch.setattr(untied, "project", recorded)
    gc.collect()
    gc.disable()
    try:
        with tracker:
            out = untied.untied_attend(x, rope, attn, None, head_chunk=1)
            out.sum().backward()  # K recomputed once a group: the same 4 calls again
        del out
    finally:
        gc.enable()
    assert len(live_at_k) == 8, live_at_k
    forward, backward = live_at_k[:4], live_at_k[4:]
    steps = [b - a for a, b in zip(forward, forward[1:])]
    assert all(0 <= step < k_bytes for step in steps), (live_at_k, k_bytes)
    # backward: the lse each stage used goes, and the group's K/V before the next group's
    steps = [b - a for a, b in zip(backward, backward[1:])]
    assert all(abs(step) < k_bytes for step in steps), (live_at_k, k_bytes)
