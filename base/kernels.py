"""kernels.py - the attention kernels every file calls, in one place.

Three functions, two ways to call a kernel, both causal softmax(q k^T / sqrt(D)) v over local
tensors in the layout q (B, S, H, D), k and v (B, S, Hkv, D), H % Hkv == 0 (query head h uses
KV head h // (H // Hkv)):

  causal_attention(q, k, v) -> out                 the model's seam 1 and Ulysses' (02) kernel:
                                                   autograd does the backward.
  attention_forward_lse(q, k, v) -> (out, lse)     Untied Ulysses (05) and the ring (06) run
  attention_backward_lse(dout, q, k, v, out, lse)  their own backward per stage from the saved
                                                   log-sum-exp, so it needs the forward and the
                                                   backward kernel separately; no attention
                                                   forward is re-run.

Which kernel runs (`--attn-kernel`, set once per process with `use_kernel`):
  fa4     FlashAttention-4 (`pip install flash-attn-4`, Hopper and Blackwell GPUs): the fastest
          on H100/H200 (1.1-1.2x cuDNN at 128K-1M); its forward returns the log-sum-exp and its
          backward takes it, and it reads grouped-query K/V natively.
  cudnn   SDPA's cuDNN kernel; for 05, 06 and keep-attention its private ATen forward/backward
          ops.
  flash   SDPA's flash kernel (FlashAttention-2 inside torch; Ampere GPUs).
  math    the plain formula (tests, debugging).
  auto    on a GPU in 16-bit the first of fa4 > cudnn > flash that passes a small check against
          the math kernel (once per dtype and head size); on the CPU torch's CPU kernel; on a
          GPU in fp32 (the tests' references) "math": seam 1 then lets SDPA pick (its
          memory-efficient kernel), 05, 06 and keep-attention run the plain formula (S x S
          scores: short sequences only).
What the chosen backward allocates for itself: support/byte_counts.py's `backward_workspace_bytes`.

Packed documents (data.py): every entry point takes `cu_seqlens`, the document boundaries of the
batch as global token offsets: the B*S tokens of q taken as one stream (row b starts at b*S), a
tuple of ints (0, start of the 2nd document, ..., B*S) - FlashAttention's `cu_seqlens`, with
every row start among them. Attention is then causal *within* each document and never crosses a
boundary. This is the one place documents are masked; `document_spans` reads the tuple. With
FlashAttention-4 one varlen launch covers all documents (q, k, v as one (B*S, heads, D) stream,
int32 cu_seqlens), once its varlen forward and backward have passed their own check against the
math kernel per document, for the head size and head counts in use (`varlen_works`: its
gradients are wrong at some head sizes - head_dim 8 in flash-attn-4 4.0.0b36, docs/gpu_tests.json -
so it is never trusted unchecked). Otherwise a loop runs the dense causal
kernel once per document: exact, slower for many short documents (one launch each). Either way
the log-sum-exp is only handed back to the backward of the same path. `use_varlen(False)` forces
the loop (tests/test_packed.py runs both).
"""

import functools
import logging
import warnings

import torch
import torch.nn.functional as F

log = logging.getLogger("kernels")

KERNELS = ("auto", "fa4", "cudnn", "flash", "math")
_requested = {"kernel": "auto", "varlen": True}  # this process's --attn-kernel; FA4 varlen allowed


@functools.cache  # a failed import is looked for again on every call: the planner asks often
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


def use_varlen(enabled: bool) -> None:
    """Allow (default) or forbid FlashAttention-4's varlen launch for packed documents."""
    _requested["varlen"] = enabled


# ---------------------------------------------------------------------------------------------
# Dense causal attention (seam 1; Ulysses' kernel over the full sequence of its heads).
# ---------------------------------------------------------------------------------------------

def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sdpa_only: bool = False, cu_seqlens=None) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(D)) v. q: (B, S, H, D); k, v: (B, S, Hkv, D), H % Hkv == 0.

    sdpa_only=True stays on F.scaled_dot_product_attention (what torch's own context
    parallelism intercepts; bench/ring.py). cu_seqlens: packed documents (module docstring),
    each attending only to itself.
    """
    if cu_seqlens is not None:
        return document_attention(q, k, v, cu_seqlens, sdpa_only)
    if q.shape[1] == 1:  # one token (a 1-token document) sees only itself: softmax over one key
        # is 1, the output its value - no kernel needed, and cuDNN refuses key/value length 1
        return v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    kernel = "sdpa" if sdpa_only else lse_kernel(q)[0]
    if kernel == "fa4":
        from flash_attn.cute import flash_attn_func

        return flash_attn_func(q, k, v, causal=True)[0]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (B, heads, S, D)
    gqa = k.shape[1] != q.shape[1]
    if not q.is_cuda and kernel != "math":  # torch's CPU kernel (--attn-kernel math: below)
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


def varlen_args(q, k, v, cu_seqlens) -> dict:
    """FlashAttention-4's varlen arguments: q, k, v as one stream of (B*S, heads, D), the
    boundaries as int32 on the device, the longest document."""
    bounds = _device_bounds(tuple(int(b) for b in cu_seqlens), q.device)
    longest = max(int(b) - int(a) for a, b in zip(cu_seqlens, cu_seqlens[1:]))
    return dict(q=q.flatten(0, 1), k=k.flatten(0, 1), v=v.flatten(0, 1), cu_seqlens_q=bounds,
                cu_seqlens_k=bounds, max_seqlen_q=longest, max_seqlen_k=longest)


@functools.lru_cache(maxsize=4)
def _device_bounds(cu_seqlens: tuple, device: torch.device) -> torch.Tensor:
    """cu_seqlens as int32 on the device, copied once per batch (not per layer and stage)."""
    return torch.tensor(cu_seqlens, dtype=torch.int32, device=device)


def _varlen_forward(q, k, v, cu_seqlens):
    """(out (B, S, H, D), lse (H, B*S)) of FA4's varlen forward."""
    from flash_attn.cute import flash_attn_varlen_func

    with torch.no_grad():  # its autograd Function: only the forward here
        out, lse = flash_attn_varlen_func(**varlen_args(q, k, v, cu_seqlens), causal=True,
                                          return_lse=True)
    return out.view_as(q), lse


def _varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens):
    """(dq, dk, dv) of `_varlen_forward`: FA4's backward entry point with the boundaries."""
    from flash_attn.cute.interface import _flash_attn_bwd

    args = varlen_args(q, k, v, cu_seqlens)
    grads = _flash_attn_bwd(args.pop("q"), args.pop("k"), args.pop("v"), out.flatten(0, 1),
                            grad_out.flatten(0, 1), lse, causal=True, **args)[:3]
    return tuple(g.view_as(t) for g, t in zip(grads, (q, k, v)))


def document_attention(q, k, v, cu_seqlens, sdpa_only: bool = False):
    """`causal_attention` within each document of `cu_seqlens`: FA4's varlen launch where it
    passed its check, else one dense causal call per document, outputs concatenated along the
    sequence (autograd does the backward either way)."""
    batch, seq_len = q.shape[:2]
    spans = document_spans(cu_seqlens, batch, seq_len)
    if len(spans) == batch:  # one document per row: the dense kernel as it is
        return causal_attention(q, k, v, sdpa_only)
    if not sdpa_only and varlen_works(q, k):
        from flash_attn.cute import flash_attn_varlen_func

        return flash_attn_varlen_func(**varlen_args(q, k, v, cu_seqlens), causal=True)[0].view_as(q)
    # torch.split, not slicing: its backward writes all the documents' gradients into one
    # tensor, where each slice's backward would allocate (and zero) a q-sized gradient.
    lengths = [[end - start for r, start, end in spans if r == row] for row in range(batch)]
    rows = []
    for row, (q_row, k_row, v_row) in enumerate(zip(q.split(1), k.split(1), v.split(1))):
        documents = zip(*(t.split(lengths[row], dim=1) for t in (q_row, k_row, v_row)))
        rows.append(torch.cat([causal_attention(*doc, sdpa_only) for doc in documents], dim=1))
    return torch.cat(rows, dim=0)


# ---------------------------------------------------------------------------------------------
# Attention that returns its log-sum-exp, and a backward that takes it (05, 06, --keep-attention).
# ---------------------------------------------------------------------------------------------
# lse: fp32, (B, H, S) or (B, H, S, 1) depending on the kernel, (H, B*S) from FA4's varlen
# launch for packed documents - only ever handed back to `attention_backward_lse`. The kernels
# are FlashAttention-4's forward and backward functions, or private ATen ops (what SDPA calls
# inside); each one is checked once per device/dtype/head size against the plain math below, and
# the first that works is used.

def math_attention_forward(q, k, v, causal: bool = True):
    """Reference kernel in fp32 with explicit scores (B, Hkv, G, Sq, Sk): small inputs only.
    causal=False: every query sees every key (q and k/v may differ in length)."""
    batch, seq_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    # (B, Hkv, G, S, D): query head h = kv * G + g uses KV head kv.
    qg = q.float().permute(0, 2, 1, 3).unflatten(1, (n_kv_heads, -1))
    kg, vg = (t.float().permute(0, 2, 1, 3)[:, :, None] for t in (k, v))
    scores = (qg @ kg.transpose(-1, -2)) * head_dim**-0.5
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(-1)
    out = (scores - lse[..., None]).exp() @ vg
    out = out.flatten(1, 2).permute(0, 2, 1, 3).to(q.dtype)
    return out, lse.flatten(1, 2)


def math_attention_backward(grad_out, q, k, v, out, lse, causal: bool = True):
    """Gradients of `math_attention_forward` from its saved lse (no softmax forward re-run)."""
    batch, seq_len, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[2]
    scale = head_dim**-0.5
    to_groups = lambda t: t.float().permute(0, 2, 1, 3).unflatten(1, (n_kv_heads, -1))
    qg, dog, og = to_groups(q), to_groups(grad_out), to_groups(out)
    kg, vg = (t.float().permute(0, 2, 1, 3)[:, :, None] for t in (k, v))
    scores = (qg @ kg.transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    probs = (scores - lse.unflatten(1, (n_kv_heads, -1))[..., None]).exp()
    grad_v = (probs.transpose(-1, -2) @ dog).sum(2)
    grad_probs = dog @ vg.transpose(-1, -2)
    grad_scores = probs * (grad_probs - (dog * og).sum(-1, keepdim=True)) * scale
    grad_q = grad_scores @ kg
    grad_k = (grad_scores.transpose(-1, -2) @ qg).sum(2)
    back = lambda t, like: t.flatten(1, 2).permute(0, 2, 1, 3).to(like.dtype)
    return back(grad_q, q), back(grad_k[:, :, None], k), back(grad_v[:, :, None], v)


def _forward(kernel, q, k, v, causal: bool = True):
    """(out, lse) of one kernel, q/k/v and out in the layout above."""
    if kernel == "fa4":
        from flash_attn.cute import flash_attn_func

        with torch.no_grad():  # its autograd Function: only the forward here
            return flash_attn_func(q, k, v, causal=causal, return_lse=True)
    # (B, S, heads, D) -> (B, heads, S, D) as views, no copy: the ATen kernels read strided
    # tensors (a contiguous copy of each costs ~1% of a 128K step, measured: docs/calibration.md).
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if kernel == "cudnn":  # compute_log_sumexp=True, dropout 0, causal or not, no debug mask
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False)[:2]
    elif kernel == "flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False)[:2]
    elif kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return out.transpose(1, 2), lse


def _backward(kernel, grad_out, q, k, v, out, lse, causal: bool = True):
    """(dq, dk, dv) of one kernel from its out and lse (layout above)."""
    if kernel == "fa4":
        from flash_attn.cute.interface import _flash_attn_bwd  # its backward entry point

        return _flash_attn_bwd(q, k, v, out, grad_out, lse, causal=causal)[:3]
    # grad_out and out in the same layout (cuDNN before 9.5.1 requires equal strides).
    grad_out, q, k, v, out = (t.contiguous().transpose(1, 2) for t in (grad_out, q, k, v, out))
    seq_q, seq_k = q.shape[2], k.shape[2]
    # Dropout is off, so the random-state arguments are never read; pass defined placeholders.
    unused = torch.zeros((), dtype=torch.int64, device=q.device)
    # The ATen kernels read lse as dense, whatever its strides: under cuDNN a document's slice of
    # a packed row's lse (the loop in attention_backward_lse) gave gradients 7x off (gpu_tests).
    lse = lse.contiguous()
    if kernel == "cudnn":  # attn_bias, cum_seq_q, cum_seq_k = None: dense, unmasked beyond causal
        if lse.dim() == 3:  # (B, H, S), e.g. a ring's merged lse: cuDNN reads (B, H, S, 1) only
            lse = lse.unsqueeze(-1)
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad_out, q, k, v, out, lse, unused, unused, None, None, None, seq_q, seq_k, 0.0,
            causal)
    elif kernel == "flash":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, seq_q, seq_k, 0.0, causal, unused, unused)
    elif kernel == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal)
    else:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    return tuple(t.transpose(1, 2) for t in grads[:3])


def kernel_for_length(tokens: int, kernel: str | None) -> str | None:
    """The kernel for attention over `tokens` queries or keys (one document of the loops below,
    one block pair of 06's ring): a single one goes to the math kernel (exact, and cheap at one
    token), as cuDNN refuses key/value length 1."""
    return "math" if tokens == 1 else kernel


def attention_forward_lse(q, k, v, kernel: str | None = None, cu_seqlens=None,
                          causal: bool = True):
    """Causal attention (layout above) -> (out (B, S, H, D), lse). cu_seqlens: within each
    packed document only; lse is then the documents' log-sum-exps along the sequence.
    causal=False: every query sees every key, and q may be longer or shorter than k/v (one
    block pair of ring attention, 06); not with cu_seqlens."""
    if not causal and cu_seqlens is not None:
        raise ValueError("cu_seqlens masks packed documents causally; causal=False takes none")
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(f"causal attention needs as many queries ({q.shape[1]}) as keys "
                         f"({k.shape[1]}); pass causal=False for a full block")
    if cu_seqlens is not None:
        batch, seq_len = q.shape[:2]
        spans = document_spans(cu_seqlens, batch, seq_len)
        if len(spans) > batch and kernel is None and varlen_works(q, k):
            return _varlen_forward(q, k, v, cu_seqlens)  # one launch; lse (H, B*S)
        if len(spans) > batch:
            outs, lses = [[] for _ in range(batch)], [[] for _ in range(batch)]
            for row, start, end in spans:
                part = (slice(row, row + 1), slice(start, end))
                alone = kernel_for_length(end - start, kernel)
                out, lse = attention_forward_lse(q[part], k[part], v[part], alone)
                outs[row].append(out)
                lses[row].append(lse)
            # lse is (1, H, s) or (1, H, s, 1) (cuDNN): the sequence is dim 2 either way
            dims = max(l.dim() for row in lses for l in row)
            lses = [[l.view(*l.shape, *[1] * (dims - l.dim())) for l in row] for row in lses]
            return (torch.cat([torch.cat(o, dim=1) for o in outs], dim=0),
                    torch.cat([torch.cat(l, dim=2) for l in lses], dim=0))
    kernel, native_gqa = lse_kernel(q, kernel)
    if kernel == "math":
        return math_attention_forward(q, k, v, causal)
    if not native_gqa and k.shape[2] != q.shape[2]:
        group = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    return _forward(kernel, q, k, v, causal)


def attention_backward_lse(grad_out, q, k, v, out, lse, kernel: str | None = None,
                           cu_seqlens=None, causal: bool = True):
    """(dq, dk, dv) of `attention_forward_lse` from its out and lse: the attention backward
    kernel alone, no forward recomputation. cu_seqlens, causal: as given to the forward."""
    if cu_seqlens is not None:
        batch, seq_len = q.shape[:2]
        spans = document_spans(cu_seqlens, batch, seq_len)
        if len(spans) > batch and kernel is None and varlen_works(q, k):
            return _varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens)
        if len(spans) > batch:
            grads = [[[] for _ in range(batch)] for _ in range(3)]
            for row, start, end in spans:
                part = (slice(row, row + 1), slice(start, end))
                lse_part = lse[row:row + 1, :, start:end]
                alone = kernel_for_length(end - start, kernel)
                if alone == "math":
                    lse_part = lse_part.flatten(2)  # the math kernel's (1, H, s)
                for collected, grad in zip(grads, attention_backward_lse(
                        grad_out[part], q[part], k[part], v[part], out[part], lse_part, alone)):
                    collected[row].append(grad)
            return tuple(torch.cat([torch.cat(g, dim=1) for g in rows], dim=0) for rows in grads)
    kernel, native_gqa = lse_kernel(q, kernel)
    if kernel == "math":
        return math_attention_backward(grad_out, q, k, v, out, lse, causal)
    n_kv_heads, group = k.shape[2], q.shape[2] // k.shape[2]
    if not native_gqa and group > 1:
        k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    dq, dk, dv = _backward(kernel, grad_out, q, k, v, out, lse, causal)
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
    if requested in ("fa4", "cudnn", "flash") and device != "cuda":
        requested = "auto"  # a GPU kernel by name: CPU tensors (a test's reference) keep theirs
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
                raise ValueError(f"attention kernel {requested} failed its check on "
                                   f"{device}/{dtype}/head_dim {head_dim}; see the warning above")
        log.info("attention kernel on %s %s head_dim %d: %s (native GQA: %s)",
                 device, dtype, head_dim, *choice)
        _KERNEL_CHOICE[key] = choice
    return _KERNEL_CHOICE[key]


def _check_kernel(kernel, device, dtype, head_dim):
    """Run `kernel` forward and backward on a small causal problem with 2 query heads per KV
    head and compare with the math kernel. Returns True (correct with fewer KV heads), False
    (correct only with KV heads repeated) or None (unusable: the warning says why).
    1000 tokens: several of the kernels' 64-128-token blocks, the last one partial. One block is
    not enough: FlashAttention-4 4.0.0b36's backward at head_dim 8 passes at 64 tokens and is
    wrong on longer sequences (dq 0.9 off; docs/gpu_tests.json)."""
    generator = torch.Generator().manual_seed(0)
    seq_len = 1000
    # Inputs rounded to `dtype` first, so only the kernel's own rounding is compared.
    q, grad_out = (torch.randn(1, seq_len, 4, head_dim, generator=generator).to(dtype).float()
                   for _ in range(2))
    k, v = (torch.randn(1, seq_len, 2, head_dim, generator=generator).to(dtype).float()
            for _ in range(2))
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
            for name, got, ref in zip(("out", "dq", "dk", "dv"), (out.float().cpu(), dq, dk, dv),
                                      want):
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


_VARLEN_CHECKED = {}  # (dtype, head_dim, query heads, KV heads) -> FA4's varlen passed its check


def varlen_works(q, k) -> bool:
    """Whether packed documents like q's and k's go through FA4's varlen launch: FA4 is this
    process's kernel for q, varlen is allowed (`use_varlen`), and its forward and backward passed
    `_check_varlen` for this dtype, head size and number of query and KV heads (once per process;
    a failure warns): its kernels differ by these, and so can its bugs."""
    if not (_requested["varlen"] and q.is_cuda and lse_kernel(q)[0] == "fa4"):
        return False
    key = (q.dtype, q.shape[-1], q.shape[2], k.shape[2])
    if key not in _VARLEN_CHECKED:
        try:
            _check_varlen(q.device, *key)
            _VARLEN_CHECKED[key] = True
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            warnings.warn(f"FlashAttention-4 varlen on {q.dtype}/head_dim {q.shape[-1]}/"
                          f"{q.shape[2]} query and {k.shape[2]} KV heads failed its check "
                          f"({type(error).__name__}: {error}); packed documents use the "
                          "per-document loop")
            _VARLEN_CHECKED[key] = False
        log.info("FlashAttention-4 varlen for packed documents, %s head_dim %d, %d/%d heads: %s",
                 *key, "yes" if _VARLEN_CHECKED[key] else "no (per-document loop)")
    return _VARLEN_CHECKED[key]


def _check_varlen(device, dtype, head_dim, n_heads, n_kv_heads,
                  lengths=(37, 1, 90, 64, 64, 200, 56), batch=2):
    """FA4's varlen forward and backward on packed documents (rows of sum(lengths) / batch
    tokens, a 1-token document; no document crosses a row) against the math kernel run on each
    document alone (the per-document loop of `attention_forward_lse`). Raises RuntimeError
    naming the first output that differs."""
    generator = torch.Generator().manual_seed(0)
    seq_len = sum(lengths) // batch
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    q, grad_out = (torch.randn(batch, seq_len, n_heads, head_dim,
                               generator=generator).to(dtype).float()
                   for _ in range(2))
    k, v = (torch.randn(batch, seq_len, n_kv_heads, head_dim, generator=generator).to(dtype).float()
            for _ in range(2))
    out, lse = attention_forward_lse(q, k, v, "math", bounds)
    wants = (out, *attention_backward_lse(grad_out, q, k, v, out, lse, "math", bounds))
    args = [t.to(device, dtype) for t in (q, k, v)]
    out, lse = _varlen_forward(*args, bounds)
    grads = _varlen_backward(grad_out.to(device, dtype), *args, out, lse, bounds)
    for name, want, got in zip(("out", "dq", "dk", "dv"), wants, (out, *grads)):
        got = got.float().cpu()
        error = (got - want).abs().max().item()
        if not error <= 3e-2 * (1 + want.abs().max().item()):
            raise RuntimeError(f"{name} differs from the math kernel per document by {error:.3g}")

