"""Untied Ulysses vs Ulysses: one Llama-3-8B attention sub-layer over P GPUs, memory and time.

    torchrun --nproc-per-node 2 -m bench.untied                       # 512K and 1M tokens (~6 min)
    torchrun --nproc-per-node 2 -m bench.untied --seq-lens 512K --chunks 2 16
    torchrun --nproc-per-node 2 -m bench.untied --seq-lens 128K --chunks 2 16 --profile --name untied_profile

The sub-layer is the model's `attend` seam: normed input x (S/P local tokens, 4096) -> Q/K/V
projections, rotary, attention, output (S/P, 32 x 128) before o_proj; forward and backward with
an output gradient given, in bf16 (dim 4096, 32 query / 8 KV heads, head dim 128).
  - Ulysses: model.Attention with 02's all-to-all core (all of a rank's heads at once);
  - Untied Ulysses: 05's staged sub-layer for each head chunk U in --chunks.
Memory: peak allocated above the inputs (x, the output gradient, the weights) during forward +
backward. Time: CUDA events, median of --repeats after a warm-up (the memory run); above
--single-run-above tokens one run gives both (a 1M-token fwd+bwd takes ~30 s).
Each Untied run's output and input gradient are compared with Ulysses' (max relative difference;
bf16 rounding expected). Targets: at U = P the peak above the input is at most half of
Ulysses'; time within 3% of Ulysses at >= 512K tokens. A configuration that runs out of memory
is recorded as OOM.
"""

import argparse
import gc
import importlib
import os
import time
from functools import partial

import torch
import torch.distributed as dist

from support import byte_counts, kernels
import model as llama
from bench.report import end_distributed, profile, refuse_without_gpu, write_result
from support.data import parse_tokens

ulysses = importlib.import_module("02_ulysses")
untied = importlib.import_module("05_untied_ulysses")
GiB = 2**30


def run_once(attend, x, rope, grad_out, attn):
    x.grad = None
    attn.zero_grad(set_to_none=True)
    out = attend(x, rope)
    out.backward(grad_out)
    return out.detach()


def timed_ms(fn) -> float:
    if not torch.cuda.is_available():  # CPU smoke run
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def max_relative_difference(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def measure(attend, x, rope, grad_out, attn, repeats: int) -> dict:
    """Peak above the inputs from one run (also the warm-up), then the median time; x.grad of
    the last run is left in place."""
    last = {}
    fn = lambda: last.update(out=run_once(attend, x, rope, grad_out, attn))
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    first_ms = timed_ms(fn)
    peak = (torch.cuda.max_memory_allocated() - base) / GiB if on_gpu else None
    if repeats:
        times = sorted(timed_ms(fn) for _ in range(repeats))
        time_ms = times[len(times) // 2]
    else:
        time_ms = first_ms
    return {"peak_above_input_gib": peak, "time_ms": time_ms, "first_run_ms": first_ms,
            "timed_runs": repeats or 1}, last["out"]


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--seq-lens", nargs="+", default=["512K", "1M"])
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--single-run-above", default="512K",
                        help="longer sequences: one run gives memory and time")
    parser.add_argument("--profile", action="store_true",
                        help="one more fwd+bwd per configuration under torch.profiler: top ops by own device time")
    parser.add_argument("--name", default=None,
                        help="result file name (default untied_attention, untied_attention_cpu on a CPU)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default $OUT or docs/results)")
    opts = parser.parse_args()
    refuse_without_gpu("untied.py", opts.model,
                       cpu_form="torchrun --nproc-per-node 2 -m bench.untied --model tiny "
                                "--seq-lens 256 --chunks 2 8 --repeats 1")

    on_gpu = torch.cuda.is_available()  # a CPU run (gloo, fp32) is a smoke test: time only
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank, sp = dist.get_rank(), dist.get_world_size()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    group = dist.group.WORLD
    args = llama.get_model_args(opts.model)
    torch.manual_seed(0)
    with torch.device(device):
        attn = llama.Attention(args).to(dtype)
    for p in attn.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    lse_kernel = kernels.lse_kernel(torch.empty(1, 1, 1, args.head_dim, device=device, dtype=dtype))
    chunks = [c for c in opts.chunks if c in untied.valid_head_chunks(args, sp)]
    if rank == 0 and chunks != opts.chunks:
        print(f"skipping head chunks {sorted(set(opts.chunks) - set(chunks))}: not valid for "
              f"{args.n_heads}/{args.n_kv_heads} heads over {sp} ranks")

    rows = []
    for text in opts.seq_lens:
        seq_len = parse_tokens(text)
        ulysses.check_ulysses_shapes(args.n_heads, args.n_kv_heads, sp, seq_len)
        local = seq_len // sp
        repeats = 0 if seq_len > parse_tokens(opts.single_run_above) else opts.repeats
        positions = torch.arange(rank * local, (rank + 1) * local, device=device)[None]
        rope = llama.rope_cos_sin(positions, args, dtype)
        x = torch.randn(1, local, args.dim, device=device, dtype=dtype, requires_grad=True)
        grad_out = torch.randn(1, local, args.n_heads * args.head_dim, device=device, dtype=dtype)
        configs = [("ulysses", None)] + [("untied", c) for c in chunks]
        baseline = reference = None
        for method, chunk in configs:
            if method == "ulysses":
                attn.core = partial(ulysses.ulysses_attention, group=group)
                attend = attn.attend
                planned = byte_counts.attention_activation_bytes(args, seq_len, sp)
            else:
                attend = partial(untied.untied_attend, attn=attn, group=group, head_chunk=chunk)
                planned = byte_counts.untied_attention_bytes(args, seq_len, sp, chunk)
            row = {"seq_len": seq_len, "local_tokens": local, "method": method,
                   "head_chunk": chunk, "stages": None if chunk is None else args.n_heads // chunk,
                   "planned_gib": planned / GiB}
            try:
                measured, out = measure(attend, x, rope, grad_out, attn, repeats)
                row.update(measured)
                if method == "ulysses":  # kept to check that every chunk size computes the same
                    reference = out, x.grad
                elif reference is not None:
                    row["max_rel_diff_out"] = max_relative_difference(out, reference[0])
                    row["max_rel_diff_grad_x"] = max_relative_difference(x.grad, reference[1])
                del out
                if opts.profile:
                    row.update(profile(lambda: run_once(attend, x, rope, grad_out, attn)))
            except torch.OutOfMemoryError as error:  # (both ranks fail alike: same shapes)
                row.update(peak_above_input_gib=None, time_ms=None, oom=str(error).splitlines()[0])
            x.grad = None
            attn.zero_grad(set_to_none=True)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            dist.barrier()
            if method == "ulysses":
                baseline = row
            elif baseline and baseline["time_ms"] and row["time_ms"]:
                row["time_vs_ulysses"] = row["time_ms"] / baseline["time_ms"]
                row["target_time_within_3pct"] = row["time_vs_ulysses"] <= 1.03
                if baseline["peak_above_input_gib"] and row["peak_above_input_gib"]:
                    row["peak_vs_ulysses"] = row["peak_above_input_gib"] / baseline["peak_above_input_gib"]
                    if chunk == sp:
                        row["target_peak_half_of_ulysses"] = row["peak_vs_ulysses"] <= 0.5
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
        del x, grad_out, rope, reference

    if rank == 0:
        print(f"\n{opts.model} attention sub-layer (attend seam) fwd+bwd over {sp} ranks, {dtype}; "
              f"Untied kernel: {lse_kernel[0]} (native GQA: {lse_kernel[1]}); Ulysses kernel: "
              f"{kernels.attention_kernel_name(device, dtype)}")
        print(f"{'tokens':>8} {'method':>8} {'U':>3} {'stages':>6} {'peak GiB':>9} {'x Uly':>6} "
              f"{'time ms':>9} {'x Uly':>6} {'planned GiB':>11} {'diff':>7}  targets")
        for r in rows:
            oom = "oom" in r
            peak = "OOM" if oom else fmt(r["peak_above_input_gib"], ".2f")
            ratio = lambda key: fmt(r.get(key, 1.0 if r["method"] == "ulysses" else None), ".3f")
            targets = []
            if "target_peak_half_of_ulysses" in r:
                targets.append(f"peak <= 0.5x: {'PASS' if r['target_peak_half_of_ulysses'] else 'FAIL'}")
            if "target_time_within_3pct" in r and r["seq_len"] >= 2**19:
                targets.append(f"time <= 1.03x: {'PASS' if r['target_time_within_3pct'] else 'FAIL'}")
            print(f"{r['seq_len']:>8} {r['method']:>8} {r['head_chunk'] or '-':>3} "
                  f"{r['stages'] or '-':>6} {peak:>9} {ratio('peak_vs_ulysses'):>6} "
                  f"{fmt(r['time_ms'], '.0f'):>9} {ratio('time_vs_ulysses'):>6} "
                  f"{r['planned_gib']:>11.2f} {fmt(r.get('max_rel_diff_out'), '.1e'):>7}  "
                  f"{', '.join(targets)}")
        write_result(opts.name or ("untied_attention" if on_gpu else "untied_attention_cpu"), {
            "what": f"one {opts.model} attention sub-layer (normed x -> pre-o_proj output), "
                    f"fwd+bwd, {dtype}, {sp} ranks; peak = max allocated above x, grad_out, weights",
            "untied_kernel": lse_kernel[0], "untied_kernel_native_gqa": lse_kernel[1],
            "ulysses_kernel": kernels.attention_kernel_name(device, dtype),
            "targets": "at U = P peak <= 0.5 x Ulysses; time <= 1.03 x Ulysses at >= 512K",
            "rows": rows}, opts.out)
    end_distributed()


if __name__ == "__main__":
    main()
