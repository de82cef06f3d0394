"""04's fp32 weight-gradient sums over tiles, two ways, on one GPU: what 04 did until its
backward was written by hand (each tile's weight gradient as a bf16 matmul, then added into the
fp32 sum: fp32 += bf16) against what it does since, on CUDA (04's add_matmul): one matmul
that accumulates into the fp32 sum itself (torch.addmm with out_dtype=float32: cuBLAS reads the
fp32 sum as its C and writes it back). Time per tile and the error of the sum against fp64.

    python3 -m bench.grad_sums          # Llama-3-8B's MLP and lm_head tiles, Llama-3.2-3B's MLP

Why it mattered: 04 added one tile's gradient into each weight's fp32 sum per tile (per layer,
3 MLP weights x tokens / 4,096 tiles; once per step, lm_head's 128,256 x dim per loss tile).
The add read and wrote the fp32 sum and read the bf16 product: a memory-bound pass the size
of the weight, after a matmul that already accumulated in fp32 and rounded to bf16. The profile
of a 128K step showed these adds as its "mixed-dtype elementwise" kernels (docs/results.md).
"""

import argparse

import torch

from bench.report import claim_result, cuda_time_ms, refuse_without_gpu, write_result

SHAPES = {  # name: (tile tokens, weight rows, weight columns)
    "llama3-8b MLP weight, 4,096-token tile": (4096, 14336, 4096),
    "llama3-8b lm_head, 2,092-token loss tile": (2092, 128256, 4096),
    "llama3.2-3b MLP weight, 3,072-token tile": (3072, 8192, 3072),
}


def measure(tokens: int, rows: int, cols: int, repeats: int) -> dict:
    grad_out = torch.randn(tokens, rows, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, cols, device="cuda", dtype=torch.bfloat16)
    weight_grad_sum = torch.zeros(rows, cols, device="cuda")

    def bf16_matmul_then_add():  # 04 today
        weight_grad_sum.add_(grad_out.t() @ x)

    def matmul_into_fp32_sum():
        torch.addmm(weight_grad_sum, grad_out.t(), x, out_dtype=torch.float32,
                    out=weight_grad_sum)

    reference = grad_out.double().t() @ x.double()
    row = {}
    for name, fn in (("bf16_matmul_then_add", bf16_matmul_then_add),
                     ("matmul_into_fp32_sum", matmul_into_fp32_sum)):
        weight_grad_sum.zero_()
        fn()
        row[f"error_{name}"] = float((weight_grad_sum.double() - reference).norm()
                                     / reference.norm())
        row[f"ms_{name}"] = round(cuda_time_ms(fn, repeats=repeats), 4)
    row["ms_bf16_matmul_alone"] = round(cuda_time_ms(lambda: grad_out.t() @ x, repeats=repeats), 4)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--name", default="grad_sums_1gpu")
    opts = parser.parse_args()
    refuse_without_gpu("grad_sums.py")
    claim_result(opts.name, None)  # never over an earlier run's result
    torch.manual_seed(0)
    rows = {}
    for name, shape in SHAPES.items():
        rows[name] = row = measure(*shape, opts.repeats)
        print(f"{name:>42}: {row['ms_bf16_matmul_then_add']:.3f} ms -> "
              f"{row['ms_matmul_into_fp32_sum']:.3f} ms (matmul alone "
              f"{row['ms_bf16_matmul_alone']:.3f}); error {row['error_bf16_matmul_then_add']:.1e}"
              f" -> {row['error_matmul_into_fp32_sum']:.1e}")
    write_result(opts.name, {"what": __doc__.split("\n\n")[0], "dtype": "bfloat16",
                             "rows": rows})


if __name__ == "__main__":
    main()
