"""Ring attention's block pairs on one GPU: as exact as, and as fast as, one causal call.

    python -m bench.ring_blocks                         # one H200: 512K, R = 1 2 4, fa4 cudnn
    python -m bench.ring_blocks --seq-len 128K --rings 2 --kernels cudnn --repeats 1
    python -m bench.ring_blocks --device cpu --model tiny --ulysses 1 --seq-len 256 \
        --check-seq-len 128 --kernels auto --repeats 1        # CPU smoke test: numbers mean nothing

One process plays all R ranks of a zigzag ring (06_ring_attention.py) without the sends: for
every rank and step it runs 06's `forward_step` (that rank's queries against the K/V the ring
hands it at that step, block pair by block pair, merged in fp32), then 06's `backward_step`,
adding each rank's K/V gradients into their owner's (what the backward ring carries home). The
same per-step code as the distributed ring; only the transfers are left out, which the ring
overlaps with these kernels. Shapes: one GPU's heads of Llama-3-8B under Ulysses over --ulysses
GPUs (2: 16 query, 4 KV heads, head_dim 128), bf16, one sequence.

Per kernel (--kernels) and ring degree R (--rings; R = 1 is the ring's code on one rank):
  exactness at --check-seq-len: the max abs error of out, dq, dk, dv of the ring's schedule and
    of one whole-sequence call of the same kernel, each against an fp32 reference over the same
    bf16 inputs (SDPA's memory-efficient kernel in fp32); the ring should be no worse;
  rate at --seq-len: attention TFLOP/s of forward + backward, merges and bookkeeping included,
    counted as bench/throughput.py counts (causal forward 2 S^2 H D, backward 2.5x that), and
    its ratio to one causal call (kernels.attention_forward_lse + attention_backward_lse over the
    whole sequence). Target: >= 0.97x at >= 512K for R = 2 and 4.
Writes <out>/ring_blocks.json (<out>: --out, $OUT or docs/results) with the command, GIT_COMMIT
and the GPU.
"""

import argparse

import torch
import torch.nn.functional as F

from model import get_model_args
from bench.report import claim_result, peak_and_times, refuse_without_gpu, release, write_result
from base import kernels
from support.data import parse_tokens
from support.lessons import ring_sp



def ring_schedule(q, k, v, grad_out, ring: int):
    """Every rank's forward steps, then every rank's backward steps, of a zigzag ring of `ring`
    ranks. Tensors (B, S, heads, D) in zigzag order (rank r's two chunks are its S/R slice);
    returns (out, dq, dk, dv) in the same order."""
    local = lambda t: t.chunk(ring, dim=1)
    qs, ks, vs, grads = local(q), local(k), local(v), local(grad_out)
    outs, lses = [], []
    for rank in range(ring):
        out = torch.zeros(qs[rank].shape, dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], qs[rank].shape[1]), ring_sp.NO_KEY,
                         device=q.device)
        for step in range(ring):
            owner = (rank - step) % ring  # whose K/V the ring hands this rank at this step
            ring_sp.forward_step(qs[rank], ks[owner], vs[owner], out, lse, rank, owner, ring)
        outs.append(out.to(q.dtype))
        lses.append(lse)
        del out
    dqs = []
    dks, dvs = ([torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in local(kv)]
                for kv in (k, v))
    for rank in range(ring):
        dq = torch.zeros(qs[rank].shape, dtype=torch.float32, device=q.device)
        for step in range(ring):
            owner = (rank - step) % ring
            key_grads = ring_sp.backward_step(grads[rank], qs[rank], ks[owner], vs[owner],
                                                     outs[rank], lses[rank], dq, rank, owner, ring)
            ring_sp.add_key_grads(dks[owner], dvs[owner], key_grads)
        dqs.append(dq.to(q.dtype))
        del dq
    return (torch.cat(outs, dim=1), torch.cat(dqs, dim=1), torch.cat(dks, dim=1).to(k.dtype),
            torch.cat(dvs, dim=1).to(v.dtype))


def single_call(q, k, v, grad_out):
    """One causal call over the whole sequence (original order): (out, dq, dk, dv)."""
    out, lse = kernels.attention_forward_lse(q, k, v)
    return (out, *kernels.attention_backward_lse(grad_out, q, k, v, out, lse))


def fp32_reference(q, k, v, grad_out):
    """(out, dq, dk, dv) in fp32 by SDPA (memory-efficient kernel on a GPU), K/V heads repeated."""
    group = q.shape[2] // k.shape[2]
    q32, k32, v32 = (t.float().requires_grad_() for t in (q, k, v))
    args = (q32.transpose(1, 2),
            *(t.repeat_interleave(group, 2).transpose(1, 2) for t in (k32, v32)))
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = F.scaled_dot_product_attention(*args, is_causal=True).transpose(1, 2)
    else:
        out = F.scaled_dot_product_attention(*args, is_causal=True).transpose(1, 2)
    out.backward(grad_out.float())
    return out.detach(), q32.grad, k32.grad, v32.grad


def max_errors(got, want) -> dict:
    return {name: (g.float() - w).abs().max().item()
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


def inputs(seq_len, heads, kv_heads, head_dim, device, dtype, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    make = lambda n: torch.randn(1, seq_len, n, head_dim, device=device, dtype=dtype,  # noqa: E731
                                 generator=generator)
    return make(heads), make(kv_heads), make(kv_heads), make(heads)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--ulysses", type=int, default=2,
                        help="the heads of one GPU of Ulysses over this many")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-len", default="512K", help="for the rates")
    parser.add_argument("--check-seq-len", default="32K", help="for the errors (fp32 reference)")
    parser.add_argument("--rings", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--kernels", nargs="+", default=["fa4", "cudnn"], choices=kernels.KERNELS)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up")
    parser.add_argument("--name", default="ring_blocks")
    parser.add_argument("--out", default=None,
                        help="directory for the JSON (default $OUT or docs/results)")
    opts = parser.parse_args(argv)
    refuse_without_gpu("ring_blocks.py", opts.model, opts.device,
                       cpu_form="python -m bench.ring_blocks --device cpu --model tiny --ulysses 1 "
                                "--seq-len 256 --check-seq-len 128 --kernels auto --repeats 1")
    device = torch.device(opts.device)
    # never over an earlier run's result
    claim_result(opts.name + ("" if device.type == "cuda" else "_cpu"), opts.out)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = get_model_args(opts.model)
    heads, kv_heads = args.n_heads // opts.ulysses, max(args.n_kv_heads // opts.ulysses, 1)
    seq_len, check_len = parse_tokens(opts.seq_len), parse_tokens(opts.check_seq_len)
    for ring in opts.rings:
        ring_sp.check_ring(ring, ring, seq_len)
        ring_sp.check_ring(ring, ring, check_len)
    flops = 3.5 * 2 * seq_len**2 * heads * args.head_dim  # causal forward + 2.5x in backward
    rows = []
    for kernel in opts.kernels:
        try:
            kernels.use_kernel(kernel)
            probe = torch.empty(1, 1, 1, args.head_dim, device=device, dtype=dtype)
            name = kernels.lse_kernel(probe)[0]
        except ValueError as error:  # not installed, or failed its check on this GPU
            rows.append({"kernel": kernel, "skipped": str(error)})
            print(rows[-1], flush=True)
            continue
        # (a) exactness, against fp32
        q, k, v, grad_out = inputs(check_len, heads, kv_heads, args.head_dim, device, dtype)
        reference = fp32_reference(q, k, v, grad_out)
        single_errors = max_errors(single_call(q, k, v, grad_out), reference)
        ring_errors = {}
        for ring in opts.rings:
            order = ring_sp.zigzag_order(check_len, ring).to(device)
            got = ring_schedule(*(t[:, order] for t in (q, k, v, grad_out)), ring)
            ring_errors[ring] = max_errors([t[:, order.argsort()] for t in got], reference)
            del got
        q = k = v = grad_out = reference = None  # frees them; the lambdas below share q..grad_out
        release(device)
        # (b) rate, forward + backward
        q, k, v, grad_out = inputs(seq_len, heads, kv_heads, args.head_dim, device, dtype)
        single = peak_and_times(lambda: single_call(q, k, v, grad_out), device, opts.repeats)
        rows.append({"kernel": kernel, "kernel_used": name, "schedule": "single causal call",
                     "ring": None, "seq_len": seq_len, **single,
                     "tflops": flops / single["time_s"] / 1e12, "check_seq_len": check_len,
                     "max_abs_error": single_errors})
        print(rows[-1], flush=True)
        for ring in opts.rings:
            order = ring_sp.zigzag_order(seq_len, ring).to(device)
            zq, zk, zv, zgrad = (t[:, order] for t in (q, k, v, grad_out))
            measured = peak_and_times(lambda: ring_schedule(zq, zk, zv, zgrad, ring), device,
                                      opts.repeats)
            zq = zk = zv = zgrad = None
            release(device)
            vs_single = single["time_s"] / measured["time_s"]
            errors = ring_errors[ring]
            targeted = ring in (2, 4) and seq_len >= 2**19
            rows.append({"kernel": kernel, "kernel_used": name, "schedule": "zigzag ring",
                         "ring": ring, "seq_len": seq_len, **measured,
                         "tflops": flops / measured["time_s"] / 1e12,
                         "rate_vs_single": vs_single,
                         "target_rate_097": vs_single >= 0.97 if targeted else None,
                         "check_seq_len": check_len, "max_abs_error": errors,
                         "error_vs_single": {n: errors[n] / single_errors[n]
                                             if single_errors[n] else None for n in errors}})
            print(rows[-1], flush=True)
        q = k = v = grad_out = None
        release(device)
    kernels.use_kernel("auto")
    result = {"model": opts.model, "heads": heads, "kv_heads": kv_heads, "head_dim": args.head_dim,
              "dtype": str(dtype), "rows": rows}
    write_result(opts.name + ("" if device.type == "cuda" else "_cpu"), result, opts.out)
    print(f"\n{'kernel':>6} {'schedule':>18} {'R':>2} {'ms':>9} {'TFLOP/s':>8} {'x single':>8}  "
          f"max abs error out / dq / dk / dv (single kernel's in brackets)")
    for row in rows:
        if "skipped" in row:
            print(f"{row['kernel']:>6} skipped: {row['skipped']}")
            continue
        single = next(r for r in rows if r["kernel"] == row["kernel"] and r["ring"] is None)
        errors = " / ".join(f"{row['max_abs_error'][n]:.2e} ({single['max_abs_error'][n]:.2e})"
                            for n in ("out", "dq", "dk", "dv"))
        print(f"{row['kernel']:>6} {row['schedule']:>18} {row['ring'] or '-':>2} "
              f"{row['time_s'] * 1e3:>9.1f} {row['tflops']:>8.1f} "
              f"{row.get('rate_vs_single', 1.0):>8.3f}  {errors}")


if __name__ == "__main__":
    main()
