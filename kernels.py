"""kernels.py - the attention kernels every file calls, in one place.

Two entry points, both causal softmax(q k^T / sqrt(D)) v over local tensors in the layout
q (B, S, H, D), k and v (B, S, Hkv, D), H % Hkv == 0 (query head h uses KV head h // (H // Hkv)):

  causal_attention(q, k, v) -> out                 the model's seam 1 and Ulysses' (02) kernel:
                                                   autograd does the backward.
  attention_forward_lse(q, k, v) -> (out, lse)     Untied Ulysses (05) runs its own backward
  attention_backward_lse(dout, q, k, v, out, lse)  per stage from the saved log-sum-exp, so it
                                                   needs the forward and the backward kernel
                                                   separately; no attention forward is re-run.

Packed documents (data.py): every entry point takes `cu_seqlens`, the document boundaries of the
batch as global token offsets: the B*S tokens of q taken as one stream (row b starts at b*S),
a tuple of ints (0, start of the 2nd document, ..., B*S) - FlashAttention's `cu_seqlens`, with
every row start among them. Attention is then causal *within* each document and never crosses a
boundary. This is the one place documents are masked; `document_spans` reads the tuple.
On a GPU FlashAttention-4's `flash_attn.cute.flash_attn_varlen_func` is the kernel for this
(q, k, v as (B*S, heads, D), int32 cu_seqlens on the device, causal=True, return_lse for 05;
see `document_attention`); without it, and on a CPU, a loop runs the dense causal kernel once per
document (exact, slower for many short documents: one kernel launch each). The log-sum-exp of
that loop is the per-document log-sum-exps concatenated along the sequence.

Which kernel runs: flash-attn when installed, else PyTorch's SDPA (cuDNN first on GPUs), math
on CPU; for the log-sum-exp pair, private ATen ops (what SDPA calls inside), each checked once
against the plain math below. `backward_workspace_bytes` is what the backward kernel allocates
for itself, for the planner.
"""

import logging
import os
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger("kernels")


# ---------------------------------------------------------------------------------------------
# Attention kernel: flash-attn if installed, else PyTorch SDPA (cuDNN first on GPUs), math on CPU.
# ---------------------------------------------------------------------------------------------

try:
    from flash_attn import flash_attn_func  # optional, never required
except ImportError:
    flash_attn_func = None


def attention_kernel_name(device: torch.device, dtype: torch.dtype, n_heads: int = 32,
                          n_kv_heads: int = 8, head_dim: int = 128) -> str:
    """The kernel `causal_attention` runs for these shapes (for the run log): flash-attn, or the
    first SDPA backend, in our priority order, that accepts them."""
    if device.type != "cuda":
        return "sdpa (cpu)"
    if flash_attn_func is not None and dtype in (torch.float16, torch.bfloat16):
        return "flash-attn"
    try:
        from torch.backends import cuda as backends

        q = torch.empty(1, n_heads, 128, head_dim, device=device, dtype=dtype)
        kv = torch.empty(1, n_kv_heads, 128, head_dim, device=device, dtype=dtype)
        params = backends.SDPAParams(q, kv, kv, None, 0.0, True, n_kv_heads != n_heads)
        for name, usable in (("cudnn", backends.can_use_cudnn_attention),
                             ("flash", backends.can_use_flash_attention),
                             ("efficient", backends.can_use_efficient_attention)):
            if usable(params, False):
                return f"sdpa {name}"
        return "sdpa math"
    except (ImportError, AttributeError, TypeError, RuntimeError):  # older torch: no probe
        return "sdpa (cudnn > flash > efficient > math)"


def _sdpa_backends():
    from torch.nn.attention import SDPBackend

    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     allow_flash_attn: bool = True, cu_seqlens=None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v. q: (B, S, H, D); k, v: (B, S, Hkv, D), H % Hkv == 0.

    Query head h attends with KV head h // (H // Hkv) (grouped-query attention).
    allow_flash_attn=False stays on F.scaled_dot_product_attention (what torch's own context
    parallelism intercepts; bench/ring.py). cu_seqlens: packed documents (module docstring),
    each attending only to itself.
    """
    if cu_seqlens is not None:
        return document_attention(q, k, v, cu_seqlens, allow_flash_attn)
    if (allow_flash_attn and flash_attn_func is not None and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)):
        return flash_attn_func(q, k, v, causal=True)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (B, heads, S, D)
    gqa = k.shape[1] != q.shape[1]
    if q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_sdpa_backends(), set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)


# ---------------------------------------------------------------------------------------------
# Packed documents: attention that never crosses a document boundary.
# ---------------------------------------------------------------------------------------------

def document_spans(cu_seqlens, batch: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document, positions within the row, from the global offsets
    `cu_seqlens` over batch * seq_len tokens (module docstring). ValueError when they do not
    describe this batch (a document would otherwise silently attend across rows)."""
    bounds = [int(b) for b in cu_seqlens]
    total = batch * seq_len
    if (len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total
            or any(a >= b for a, b in zip(bounds, bounds[1:]))):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to batch x sequence = {total}, "
                         f"got {bounds[:4]}...{bounds[-2:]} ({len(bounds)} entries)")
    missing = set(range(0, total, seq_len)) - set(bounds)
    if missing:
        raise ValueError(f"cu_seqlens must hold every row start (multiples of {seq_len}); "
                         f"missing {sorted(missing)[:4]}")
    return [(a // seq_len, a % seq_len, a % seq_len + (b - a)) for a, b in zip(bounds, bounds[1:])]


def document_attention(q, k, v, cu_seqlens, allow_flash_attn: bool = True):
    """`causal_attention` within each document of `cu_seqlens`: one dense causal call per
    document, outputs concatenated along the sequence (autograd does the backward).

    FlashAttention-4 slots in here (and in the two `_lse` functions) on CUDA with 16-bit
    inputs: `flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)` with q, k, v
    flattened to (B*S, heads, D), `cu = torch.tensor(cu_seqlens, dtype=torch.int32,
    device=q.device)` and `max_len` the longest document; one launch for all documents."""
    batch, seq_len = q.shape[:2]
    spans = document_spans(cu_seqlens, batch, seq_len)
    if len(spans) == batch:  # one document per row: the dense kernel as it is
        return causal_attention(q, k, v, allow_flash_attn)
    # torch.split, not slicing: its backward writes all the documents' gradients into one
    # tensor, where each slice's backward would allocate (and zero) a q-sized gradient.
    lengths = [[end - start for r, start, end in spans if r == row] for row in range(batch)]
    rows = []
    for row, (q_row, k_row, v_row) in enumerate(zip(q.split(1), k.split(1), v.split(1))):
        documents = zip(*(t.split(lengths[row], dim=1) for t in (q_row, k_row, v_row)))
        rows.append(torch.cat([causal_attention(*doc, allow_flash_attn) for doc in documents], dim=1))
    return torch.cat(rows, dim=0)


# ---------------------------------------------------------------------------------------------
# Attention that returns its log-sum-exp, and a backward that takes it (05).
# ---------------------------------------------------------------------------------------------
# Layout: q (B, S, H, D), k and v (B, S, Hkv, D) with H % Hkv == 0 (query head h uses KV head
# h // (H // Hkv)), causal, scale 1/sqrt(D); out (B, S, H, D). lse: fp32, (B, H, S) or
# (B, H, S, 1) depending on the kernel - only ever handed back to `attention_backward_lse`.
# The kernels are private ATen ops (what SDPA calls inside); each one is checked once per
# device/dtype/head size against the plain math below, and the first that works is used.
# UNTIED_ATTENTION_KERNEL=cudnn|flash|cpu|math forces one (to debug a GPU).

def math_attention_forward(q, k, v):
    """Reference kernel in fp32 with explicit scores (B, Hkv, G, S, S): small inputs only."""
    batch, seq_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    # (B, Hkv, G, S, D): query head h = kv * G + g uses KV head kv.
    qg = q.float().permute(0, 2, 1, 3).unflatten(1, (n_kv_heads, -1))
    kg, vg = (t.float().permute(0, 2, 1, 3)[:, :, None] for t in (k, v))
    scores = (qg @ kg.transpose(-1, -2)) * head_dim**-0.5
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ vg
    out = out.flatten(1, 2).permute(0, 2, 1, 3).to(q.dtype)
    return out, lse.flatten(1, 2)


def math_attention_backward(grad_out, q, k, v, out, lse):
    """Gradients of `math_attention_forward` from its saved lse (no softmax forward re-run)."""
    batch, seq_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    scale = head_dim**-0.5
    to_groups = lambda t: t.float().permute(0, 2, 1, 3).unflatten(1, (n_kv_heads, -1))
    qg, dog, og = to_groups(q), to_groups(grad_out), to_groups(out)
    kg, vg = (t.float().permute(0, 2, 1, 3)[:, :, None] for t in (k, v))
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
    scores = ((qg @ kg.transpose(-1, -2)) * scale).masked_fill(future, float("-inf"))
    probs = (scores - lse.unflatten(1, (n_kv_heads, -1))[..., None]).exp()
    grad_v = (probs.transpose(-1, -2) @ dog).sum(2)
    grad_probs = dog @ vg.transpose(-1, -2)
    grad_scores = probs * (grad_probs - (dog * og).sum(-1, keepdim=True)) * scale
    grad_q = grad_scores @ kg
    grad_k = (grad_scores.transpose(-1, -2) @ qg).sum(2)
    back = lambda t, like: t.flatten(1, 2).permute(0, 2, 1, 3).to(like.dtype)
    return back(grad_q, q), back(grad_k[:, :, None], k), back(grad_v[:, :, None], v)


def _aten_forward(kernel, q, k, v):
    """(B, heads, S, D) in, (B, H, S, D) out and lse, from one private ATen op."""
    if kernel == "cudnn":
        # compute_log_sumexp=True, dropout 0, causal, no debug mask
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False)[:2]
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[:2]
    elif kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return out, lse


def _aten_backward(kernel, grad_out, q, k, v, out, lse):
    seq_q, seq_k = q.shape[2], k.shape[2]
    # Dropout is off, so the random-state arguments are never read; pass defined placeholders.
    unused = torch.zeros((), dtype=torch.int64, device=q.device)
    if kernel == "cudnn":
        # attn_bias, cum_seq_q, cum_seq_k = None (undefined: dense, unmasked beyond causal)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, unused, unused, None, None, None, seq_q, seq_k, 0.0, True)
    if kernel == "flash":
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, seq_q, seq_k, 0.0, True, unused, unused)
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True)
    raise ValueError(f"unknown attention kernel {kernel!r}")


def _to_kernel_layout(t):
    """(B, S, heads, D) -> (B, heads, S, D) as a view, no copy: the kernels read strided
    tensors, as they do when SDPA hands them Ulysses' transposed q, k, v. A contiguous copy of
    each would cost time and memory (~1% of a 128K step and 3 q-sized tensors at 16 heads a
    stage, measured)."""
    return t.transpose(1, 2)


def attention_forward_lse(q, k, v, kernel: str | None = None, cu_seqlens=None):
    """Causal attention (layout above) -> (out (B, S, H, D), lse). cu_seqlens: within each
    packed document only; lse is then the documents' log-sum-exps along the sequence."""
    if cu_seqlens is not None:
        batch, seq_len = q.shape[:2]
        spans = document_spans(cu_seqlens, batch, seq_len)
        if len(spans) > batch:
            outs, lses = [[] for _ in range(batch)], [[] for _ in range(batch)]
            for row, start, end in spans:
                part = (slice(row, row + 1), slice(start, end))
                out, lse = attention_forward_lse(q[part], k[part], v[part], kernel)
                outs[row].append(out)
                lses[row].append(lse)
            # lse is (1, H, s) or (1, H, s, 1): the sequence is dim 2 either way
            return (torch.cat([torch.cat(o, dim=1) for o in outs], dim=0),
                    torch.cat([torch.cat(l, dim=2) for l in lses], dim=0))
    kernel, native_gqa = lse_kernel(q, kernel)
    if kernel == "math":
        return math_attention_forward(q, k, v)
    if not native_gqa and k.shape[2] != q.shape[2]:
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    out, lse = _aten_forward(kernel, *(_to_kernel_layout(t) for t in (q, k, v)))
    return out.transpose(1, 2), lse


def attention_backward_lse(grad_out, q, k, v, out, lse, kernel: str | None = None,
                           cu_seqlens=None):
    """(dq, dk, dv) of `attention_forward_lse` from its out and lse: the attention backward
    kernel alone, no forward recomputation. cu_seqlens: as given to the forward."""
    if cu_seqlens is not None:
        batch, seq_len = q.shape[:2]
        spans = document_spans(cu_seqlens, batch, seq_len)
        if len(spans) > batch:
            grads = [[[] for _ in range(batch)] for _ in range(3)]
            for row, start, end in spans:
                part = (slice(row, row + 1), slice(start, end))
                lse_part = lse[row:row + 1, :, start:end]
                for collected, grad in zip(grads, attention_backward_lse(
                        grad_out[part], q[part], k[part], v[part], out[part], lse_part, kernel)):
                    collected[row].append(grad)
            return tuple(torch.cat([torch.cat(g, dim=1) for g in rows], dim=0) for rows in grads)
    kernel, native_gqa = lse_kernel(q, kernel)
    if kernel == "math":
        return math_attention_backward(grad_out, q, k, v, out, lse)
    n_kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    if not native_gqa and group > 1:
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    # grad_out and out in the same layout (cuDNN before 9.5.1 requires equal strides).
    args = (_to_kernel_layout(t.contiguous()) for t in (grad_out, q, k, v, out))
    dq, dk, dv = (t.transpose(1, 2) for t in _aten_backward(kernel, *args, lse))
    if not native_gqa and group > 1:  # the copies of a KV head add up
        dk, dv = (t.unflatten(2, (n_kv_heads, group)).sum(3) for t in (dk, dv))
    return dq, dk, dv


_KERNEL_CHOICE = {}  # (device type, dtype, head_dim, forced name) -> (kernel, handles fewer KV heads)


def lse_kernel(q, kernel: str | None = None):
    """(kernel name, supports GQA natively) for tensors like q: the first of cuDNN > flash (CUDA,
    16-bit) or the CPU flash kernel that passes a small check against the math kernel; or the
    given `kernel`, checked only for GQA support. Logged once per choice."""
    device, dtype, head_dim = q.device.type, q.dtype, q.shape[-1]
    forced = kernel or os.environ.get("UNTIED_ATTENTION_KERNEL")
    key = (device, dtype, head_dim, forced)
    if key not in _KERNEL_CHOICE:
        if forced:
            candidates = [forced]
        elif device == "cuda" and dtype in (torch.float16, torch.bfloat16):
            candidates = ["cudnn", "flash"]
        elif device == "cpu":
            candidates = ["cpu"]
        else:
            candidates = []
        choice = ("math", True)
        for name in candidates:
            if name == "math":
                break
            works = _check_kernel(name, device, dtype, head_dim)
            if works is not None:
                choice = (name, works)
                break
            if forced:
                raise RuntimeError(f"UNTIED_ATTENTION_KERNEL={forced} failed its check on "
                                   f"{device}/{dtype}/head_dim {head_dim}; see the warning above")
        log.info("attention kernel with log-sum-exp on %s %s head_dim %d: %s (native GQA: %s)",
                 device, dtype, head_dim, *choice)
        _KERNEL_CHOICE[key] = choice
    return _KERNEL_CHOICE[key]


def _check_kernel(kernel, device, dtype, head_dim):
    """Run `kernel` forward and backward on a small causal problem with 2 query heads per KV
    head and compare with the math kernel. Returns True (correct with fewer KV heads), False
    (correct only with KV heads repeated) or None (unusable: the warning says why)."""
    generator = torch.Generator().manual_seed(0)
    shape = (1, 64, 4, head_dim)
    # Inputs rounded to `dtype` first, so only the kernel's own rounding is compared.
    q, grad_out = (torch.randn(shape, generator=generator).to(dtype).float() for _ in range(2))
    k, v = (torch.randn(1, 64, 2, head_dim, generator=generator).to(dtype).float() for _ in range(2))
    want = math_attention_forward(q, k, v)
    want = (want[0], *math_attention_backward(grad_out, q, k, v, *want))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for gqa in (True, False):
        try:
            kk, vv = (k, v) if gqa else (k.repeat_interleave(2, 2), v.repeat_interleave(2, 2))
            args = [t.to(device, dtype) for t in (q, kk, vv)]
            out, lse = _aten_forward(kernel, *(_to_kernel_layout(t) for t in args))
            out = out.transpose(1, 2)
            grads = _aten_backward(kernel, *(_to_kernel_layout(t.contiguous()) for t in
                                             (grad_out.to(device, dtype), *args, out)), lse)
            dq, dk, dv = (t.transpose(1, 2).float().cpu() for t in grads)
            if not gqa:
                dk, dv = (t.unflatten(2, (2, 2)).sum(3) for t in (dk, dv))
            for name, got, ref in zip(("out", "dq", "dk", "dv"), (out.float().cpu(), dq, dk, dv), want):
                error = (got - ref).abs().max().item()
                if not error <= tol * (1 + ref.abs().max().item()):
                    raise RuntimeError(f"{name} differs from the math kernel by {error:.3g}")
            return gqa
        except torch.OutOfMemoryError:  # a full GPU says nothing about the kernel
            raise
        except Exception as error:  # a private op: any other failure means "use the next one"
            what = "with fewer KV heads" if gqa else "with KV heads repeated"
            warnings.warn(f"attention kernel {kernel!r} on {device}/{dtype}/head_dim {head_dim} "
                          f"failed {what}: {type(error).__name__}: {error}")
    return None


# ---------------------------------------------------------------------------------------------
# What the backward kernel allocates for itself (the planner counts it).
# ---------------------------------------------------------------------------------------------

def backward_workspace_bytes(n_tokens: int, n_heads: int, n_kv_heads: int, head_dim: int,
                                     bytes_per_value: int = 2) -> int:
    """What a flash-style attention backward kernel allocates for itself, beyond its inputs and
    its dq, dk, dv, over `n_tokens` tokens with `n_heads` query and `n_kv_heads` KV heads: dq
    accumulated in fp32, with grouped-query attention dk and dv per query head before they are
    summed over the group (FlashAttention-2 does both), and an fp32 row sum of dO * O. Inferred
    from the peaks measured with cuDNN on H200s (docs/calibration.md); a CPU kernel differs."""
    q_values = n_tokens * n_heads * head_dim
    grouped = n_heads > n_kv_heads
    return 4 * q_values + (2 * q_values * bytes_per_value if grouped else 0) + 4 * n_tokens * n_heads
