"""model.rms_norm (F.rms_norm: one fused kernel on CUDA) against the same RMSNorm written op by
op, on one GPU: forward + backward time, the bytes one norm keeps for backward and its peak,
the kernels each launches, and the error of each against an fp64 reference.

    python3 -m bench.rms_norm                      # 128K tokens x 4,096 (Llama-3-8B), bf16

Why it matters: a Llama block runs two RMSNorms over the whole local sequence, forward, again
in the checkpoint's recompute, and backward. Op by op, each is ~8 elementwise kernels forward
and ~12 backward over an fp32 copy of its input (6 bytes per value kept besides its output, 24
at its backward's peak); support/byte_counts.block_recompute_bytes counts both forms.
"""

import argparse
import time

import torch

from bench.report import claim_result, refuse_without_gpu, write_result
from model import rms_norm
from support.data import parse_tokens

GiB = 2**30


def rms_norm_op_by_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """What model.rms_norm was before it called F.rms_norm (and what F.rms_norm runs off CUDA)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def measure(norm, x0, weight, grad, eps: float, repeats: int) -> dict:
    def one():
        x, w = x0.detach().requires_grad_(), weight.detach().requires_grad_()
        y = norm(x, w, eps)
        return x, w, y

    for _ in range(3):  # warm up
        x, w, y = one()
        y.backward(grad)
    del x, w, y  # before the base: their output and gradient would be freed inside the measure
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    x, w, y = one()
    kept = torch.cuda.memory_allocated() - base - y.nbytes  # saved for backward, beyond y
    y.backward(grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    result = {"y": y.detach(), "dx": x.grad, "dw": w.grad}
    del x, w, y
    start = time.perf_counter()
    for _ in range(repeats):
        xr, wr, yr = one()
        yr.backward(grad)
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) / repeats * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        xr, wr, yr = one()
        yr.backward(grad)
        torch.cuda.synchronize()
    kernels = sum(e.device_type.name == "CUDA" for e in prof.events())
    return {"ms_forward_backward": round(ms, 3), "kept_gib": round(kept / GiB, 3),
            "peak_gib": round(peak / GiB, 3), "kernels": kernels, **result}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=parse_tokens, default=2**17)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--name", default="rms_norm_1gpu")
    opts = parser.parse_args()
    refuse_without_gpu("rms_norm.py")
    claim_result(opts.name, None)  # never over an earlier run's result
    torch.manual_seed(0)
    shape, eps = (1, opts.tokens, opts.dim), 1e-5
    x0 = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(opts.dim, device="cuda")).to(torch.bfloat16)
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    x64, w64 = x0.double().requires_grad_(), weight.double().requires_grad_()
    y64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    y64.backward(grad.double())
    reference = {"y": y64.detach(), "dx": x64.grad, "dw": w64.grad}
    rows = {}
    for name, norm in (("model.rms_norm (F.rms_norm)", rms_norm),
                       ("op by op", rms_norm_op_by_op)):
        row = measure(norm, x0, weight, grad, eps, opts.repeats)
        for key, ref in reference.items():  # max error relative to the largest entry
            row[f"{key}_error"] = float((row.pop(key).double() - ref).abs().max()
                                        / ref.abs().max())
        rows[name] = row
        print(f"{name:>28}: {row['ms_forward_backward']:7.2f} ms  kept {row['kept_gib']:.2f} GiB"
              f"  peak {row['peak_gib']:.2f} GiB  {row['kernels']} kernels"
              f"  dx error {row['dx_error']:.1e}")
    write_result(opts.name, {"what": __doc__.split("\n\n")[0], "tokens": opts.tokens,
                             "dim": opts.dim, "dtype": "bfloat16", "rows": rows})


if __name__ == "__main__":
    main()
