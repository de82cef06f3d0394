"""One Ulysses attention layer of Llama-3-8B shape over P GPUs: exchange time vs kernel time, and
per-GPU attention memory with and without Ulysses.

    torchrun --nproc-per-node 2 -m bench.ulysses --seq-lens 128K 512K 1M

For each total length S: q (S/P, 32 heads, 128), k/v (S/P, 8 heads, 128) in bf16 per GPU.
  - kernel: causal attention fwd+bwd over all S tokens with H/P heads (what each GPU runs);
  - all-to-alls: the four exchanges of forward (q, k, v in; out back) and the four of backward
    (grad out in; dq, dk, dv back), timed alone on the same tensors;
  - memory: peak allocated above the inputs during fwd+bwd of the attention core, with Ulysses
    (S/P tokens per GPU) and without (one GPU holding all S tokens and all heads).
Target: all-to-all time under 10% of the kernel's at >= 512K tokens.
"""

import argparse
import importlib
import os

import torch
import torch.distributed as dist

from support import kernels
import model as llama
from bench.report import cuda_time_ms, end_distributed, refuse_without_gpu, write_result
from support.data import parse_tokens

ulysses = importlib.import_module("02_ulysses")
GiB = 2**30


def peak_above(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-lens", nargs="+", default=["128K", "512K", "1M"])
    parser.add_argument("--no-baseline-above", default="512K",
                        help="skip the no-Ulysses memory run above this length")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    refuse_without_gpu("ulysses.py")

    dist.init_process_group("nccl")
    rank, sp = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    group = dist.group.WORLD
    args = llama.get_model_args("llama3-8b")
    H, Hkv, D = args.n_heads, args.n_kv_heads, args.head_dim
    dtype = torch.bfloat16
    rows = []
    for text in opts.seq_lens:
        seq_len = parse_tokens(text)
        local = seq_len // sp
        q = torch.randn(1, local, H, D, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(1, local, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(1, local, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
        grad_out = torch.randn(1, local, H, D, device="cuda", dtype=dtype)

        def ulysses_fwd_bwd():
            ulysses.ulysses_attention(q, k, v, group).backward(grad_out)

        # What each GPU's kernel sees after the exchange: all tokens, H/P heads.
        qh = torch.randn(1, seq_len, H // sp, D, device="cuda", dtype=dtype, requires_grad=True)
        kh = torch.randn(1, seq_len, max(Hkv // sp, 1), D, device="cuda", dtype=dtype,
                         requires_grad=True)
        vh = torch.randn_like(kh, requires_grad=True)
        gh = torch.randn_like(qh)

        def kernel_fwd_bwd():
            kernels.causal_attention(qh, kh, vh).backward(gh)

        def exchanges():  # forward: q, k, v in, out back; backward: grad in, dq, dk, dv back
            for _ in range(2):
                for t in (q, k, v):
                    ulysses.all_to_all(t.detach(), group, ulysses.TO_HEADS)
                for t in (qh, kh, vh):
                    ulysses.all_to_all(t.detach(), group, ulysses.TO_TOKENS)

        repeats = 3 if seq_len <= 2**19 else 1  # a 1M-token fwd+bwd takes ~30 s
        kernel_ms = cuda_time_ms(kernel_fwd_bwd, 1, repeats)
        a2a_ms = cuda_time_ms(exchanges, 1, 5)
        ulysses_peak = peak_above(ulysses_fwd_bwd)  # also the warm-up of the timed run below
        total_ms = cuda_time_ms(ulysses_fwd_bwd, 0, repeats)
        del qh, kh, vh, gh
        baseline_peak = None
        if seq_len <= parse_tokens(opts.no_baseline_above) and rank == 0:
            # Without Ulysses one GPU holds the whole sequence with all heads.
            qf = torch.randn(1, seq_len, H, D, device="cuda", dtype=dtype, requires_grad=True)
            kf = torch.randn(1, seq_len, Hkv, D, device="cuda", dtype=dtype, requires_grad=True)
            vf = torch.randn_like(kf, requires_grad=True)
            gf = torch.randn_like(qf)
            inputs = sum(t.numel() * 2 for t in (qf, kf, vf, gf))
            baseline_peak = peak_above(lambda: kernels.causal_attention(qf, kf, vf).backward(gf))
            del qf, kf, vf, gf
        dist.barrier()
        row = {"seq_len": seq_len, "local_tokens": local, "kernel_fwd_bwd_ms": kernel_ms,
               "all_to_all_ms": a2a_ms, "ulysses_total_ms": total_ms,
               "a2a_over_kernel": a2a_ms / kernel_ms,
               "ulysses_peak_above_inputs_gib": ulysses_peak / GiB,
               "ulysses_inputs_gib": sum(t.numel() * 2 for t in (q, k, v, grad_out)) / GiB,
               "no_ulysses_peak_above_inputs_gib": None if baseline_peak is None else baseline_peak / GiB,
               "no_ulysses_inputs_gib": None if baseline_peak is None else inputs / GiB,
               "target_a2a_over_kernel": "< 0.10 at >= 512K"}
        rows.append(row)
        del q, k, v, grad_out
        torch.cuda.empty_cache()
        if rank == 0:
            print(row, flush=True)
    if rank == 0:
        print(f"\n{'tokens':>8} {'kernel ms':>10} {'a2a ms':>8} {'a2a/kern':>8} {'total ms':>9} "
              f"{'peak GiB (Ulysses)':>19} {'peak GiB (none)':>16}")
        for r in rows:
            none = "-" if r["no_ulysses_peak_above_inputs_gib"] is None else f"{r['no_ulysses_peak_above_inputs_gib']:.2f}"
            print(f"{r['seq_len']:>8} {r['kernel_fwd_bwd_ms']:>10.1f} {r['all_to_all_ms']:>8.1f} "
                  f"{r['a2a_over_kernel']:>8.3f} {r['ulysses_total_ms']:>9.1f} "
                  f"{r['ulysses_peak_above_inputs_gib']:>19.2f} {none:>16}")
        write_result("ulysses_attention", {
            "what": "one Llama-3-8B attention core (32/8 heads, D=128, bf16, causal), fwd+bwd",
            "attention_kernel": kernels.attention_kernel_name(torch.device("cuda"), dtype),
            "rows": rows}, opts.out)
    end_distributed()


if __name__ == "__main__":
    main()
