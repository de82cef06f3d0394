"""kernels.py - the attention kernels every file calls, in one place.

Two entry points, both causal softmax(q k^T / sqrt(D)) v over local tensors in the layout
q (B, S, H, D), k and v (B, S, Hkv, D), H % Hkv == 0 (query head h uses KV head h // (H // Hkv)):

  causal_attention(q, k, v) -> out                 the model's seam 1 and Ulysses' (02) kernel:
                                                   autograd does the backward.
  attention_forward_lse(q, k, v) -> (out, lse)     Untied Ulysses (05) runs its own backward
  attention_backward_lse(dout, q, k, v, out, lse)  per stage from the saved log-sum-exp, so it
                                                   needs the forward and the backward kernel
                                                   separately; no attention forward is re-run.

Which kernel runs (`--attn-kernel`, set once per process with `use_kernel`):
  fa4     FlashAttention-4 (`pip install flash-attn-4`, Hopper and Blackwell GPUs): the fastest
          on H100/H200 (1.1-1.2x cuDNN at 128K-1M); its forward returns the log-sum-exp and its
          backward takes it, and it reads grouped-query K/V natively.
  cudnn   SDPA's cuDNN kernel; for 05 its private ATen forward/backward ops.
  flash   SDPA's flash kernel (FlashAttention-2 inside torch; Ampere GPUs).
  math    the plain formula (tests, debugging).
  auto    on a GPU in 16-bit the first of fa4 > cudnn > flash that passes a small check against
          the math kernel (once per dtype and head size); on the CPU torch's CPU kernel.
`backward_workspace_bytes` is what the chosen backward allocates for itself, for the planner.
"""

import logging
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger("kernels")

KERNELS = ("auto", "fa4", "cudnn", "flash", "math")
_requested = {"kernel": "auto"}  # this process's --attn-kernel


def fa4_installed() -> bool:
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # not installed, or its CUDA libraries missing
        return False
    return True


def use_kernel(name: str) -> None:
    """Make `name` (one of KERNELS) the attention kernel of this process, or refuse clearly."""
    if name not in KERNELS:
        raise ValueError(f"--attn-kernel must be one of {', '.join(KERNELS)}, got {name!r}")
    if name == "fa4" and not fa4_installed():
        raise ValueError("--attn-kernel fa4: FlashAttention-4 is not installed "
                         "(pip install flash-attn-4, on a Hopper or Blackwell GPU)")
    _requested["kernel"] = name
    _KERNEL_CHOICE.clear()


# ---------------------------------------------------------------------------------------------
# Dense causal attention (seam 1; Ulysses' kernel over the full sequence of its heads).
# ---------------------------------------------------------------------------------------------

def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sdpa_only: bool = False) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v. q: (B, S, H, D); k, v: (B, S, Hkv, D), H % Hkv == 0.

    sdpa_only=True stays on F.scaled_dot_product_attention (what torch's own context
    parallelism intercepts; bench/ring.py).
    """
    kernel = "sdpa" if sdpa_only else lse_kernel(q)[0]
    if kernel == "fa4":
        from flash_attn.cute import flash_attn_func

        return flash_attn_func(q, k, v, causal=True)[0]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (B, heads, S, D)
    gqa = k.shape[1] != q.shape[1]
    if not q.is_cuda:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    else:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_sdpa_backends(kernel), set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return out.transpose(1, 2)


def _sdpa_backends(kernel: str):
    """SDPA's backends for `kernel`, the chosen one first (cuDNN first when not forced)."""
    from torch.nn.attention import SDPBackend

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
             SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    forced = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
              "math": SDPBackend.MATH}
    if _requested["kernel"] == kernel and kernel in forced:
        return [forced[kernel]]  # asked for by name: that one, or SDPA's error
    return order


def attention_kernel_name(device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> str:
    """The kernel attention runs on this device and dtype (for the run log)."""
    q = torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype)
    name = lse_kernel(q)[0]
    return {"fa4": "FlashAttention-4", "cudnn": "cuDNN (SDPA)", "flash": "SDPA flash (FA2)",
            "cpu": "CPU (SDPA)", "math": "math"}[name]


# ---------------------------------------------------------------------------------------------
# Attention that returns its log-sum-exp, and a backward that takes it (05).
# ---------------------------------------------------------------------------------------------
# lse: fp32, (B, H, S) or (B, H, S, 1) depending on the kernel - only ever handed back to
# `attention_backward_lse`. The kernels are FlashAttention-4's forward and backward functions,
# or private ATen ops (what SDPA calls inside); each one is checked once per device/dtype/head
# size against the plain math below, and the first that works is used.

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


def _forward(kernel, q, k, v):
    """(out, lse) of one kernel, q/k/v and out in the layout above."""
    if kernel == "fa4":
        from flash_attn.cute import flash_attn_func

        with torch.no_grad():  # its autograd Function: only the forward here
            return flash_attn_func(q, k, v, causal=True, return_lse=True)
    # (B, S, heads, D) -> (B, heads, S, D) as views, no copy: the ATen kernels read strided
    # tensors (a contiguous copy of each costs ~1% of a 128K step, measured: docs/calibration.md).
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if kernel == "cudnn":  # compute_log_sumexp=True, dropout 0, causal, no debug mask
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False)[:2]
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[:2]
    elif kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return out.transpose(1, 2), lse


def _backward(kernel, grad_out, q, k, v, out, lse):
    """(dq, dk, dv) of one kernel from its out and lse (layout above)."""
    if kernel == "fa4":
        from flash_attn.cute.interface import _flash_attn_bwd  # its backward entry point

        return _flash_attn_bwd(q, k, v, out, grad_out, lse, causal=True)[:3]
    # grad_out and out in the same layout (cuDNN before 9.5.1 requires equal strides).
    grad_out, q, k, v, out = (t.contiguous().transpose(1, 2) for t in (grad_out, q, k, v, out))
    seq_q, seq_k = q.shape[2], k.shape[2]
    # Dropout is off, so the random-state arguments are never read; pass defined placeholders.
    unused = torch.zeros((), dtype=torch.int64, device=q.device)
    if kernel == "cudnn":  # attn_bias, cum_seq_q, cum_seq_k = None: dense, unmasked beyond causal
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, unused, unused, None, None, None, seq_q, seq_k, 0.0, True)
    elif kernel == "flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, seq_q, seq_k, 0.0, True, unused, unused)
    elif kernel == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, True)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return tuple(t.transpose(1, 2) for t in grads[:3])


def attention_forward_lse(q, k, v, kernel: str | None = None):
    """Causal attention (layout above) -> (out (B, S, H, D), lse)."""
    kernel, native_gqa = lse_kernel(q, kernel)
    if kernel == "math":
        return math_attention_forward(q, k, v)
    if not native_gqa and k.shape[2] != q.shape[2]:
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    return _forward(kernel, q, k, v)


def attention_backward_lse(grad_out, q, k, v, out, lse, kernel: str | None = None):
    """(dq, dk, dv) of `attention_forward_lse` from its out and lse: the attention backward
    kernel alone, no forward recomputation."""
    kernel, native_gqa = lse_kernel(q, kernel)
    if kernel == "math":
        return math_attention_backward(grad_out, q, k, v, out, lse)
    n_kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    if not native_gqa and group > 1:
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    dq, dk, dv = _backward(kernel, grad_out, q, k, v, out, lse)
    if not native_gqa and group > 1:  # the copies of a KV head add up
        dk, dv = (t.unflatten(2, (n_kv_heads, group)).sum(3) for t in (dk, dv))
    return dq, dk, dv


_KERNEL_CHOICE = {}  # (device type, dtype, head_dim, requested) -> (kernel, handles fewer KV heads)


def lse_kernel(q, kernel: str | None = None):
    """(kernel name, supports GQA natively) for tensors like q: `kernel`, else this process's
    --attn-kernel, else (auto) the first of fa4 > cudnn > flash (CUDA, 16-bit) or the CPU
    kernel that passes a small check against the math kernel. Logged once per choice."""
    device, dtype, head_dim = q.device.type, q.dtype, q.shape[-1]
    requested = kernel or _requested["kernel"]
    key = (device, dtype, head_dim, requested)
    if key not in _KERNEL_CHOICE:
        if requested != "auto":
            candidates = [requested]
        elif device == "cuda" and dtype in (torch.float16, torch.bfloat16):
            candidates = (["fa4"] if fa4_installed() else []) + ["cudnn", "flash"]
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
            if requested != "auto":
                raise RuntimeError(f"attention kernel {requested} failed its check on "
                                   f"{device}/{dtype}/head_dim {head_dim}; see the warning above")
        log.info("attention kernel on %s %s head_dim %d: %s (native GQA: %s)",
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
            out, lse = _forward(kernel, *args)
            dq, dk, dv = (t.float().cpu() for t in _backward(kernel, grad_out.to(device, dtype),
                                                             *args, out, lse))
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
                             bytes_per_value: int = 2, kernel: str = "cudnn") -> int:
    """What the attention backward kernel allocates for itself, beyond its inputs and its dq,
    dk, dv, over `n_tokens` tokens with `n_heads` query and `n_kv_heads` KV heads.

    cuDNN (and FlashAttention-2): dq accumulated in fp32; with grouped-query attention dk and
    dv per query head before they are summed over the group; an fp32 row sum of dO * O
    (inferred from the peaks measured on H200s, docs/calibration.md).
    FlashAttention-4 (read from its backward's allocations): dq accumulated in fp32; with
    grouped-query attention dk and dv accumulated in fp32 per KV head (not per query head);
    two fp32 rows (dO * O and the log-sum-exp in base 2). A CPU kernel differs."""
    q_values, kv_values = n_tokens * n_heads * head_dim, n_tokens * n_kv_heads * head_dim
    grouped = n_heads > n_kv_heads
    if kernel == "fa4":
        return 4 * q_values + (2 * 4 * kv_values if grouped else 0) + 2 * 4 * n_tokens * n_heads
    return 4 * q_values + (2 * q_values * bytes_per_value if grouped else 0) + 4 * n_tokens * n_heads
