"""Packed documents vs dense causal attention over the same window: the cost of document masking.

    torchrun --nproc-per-node 2 -m bench.packed                        # 128K..1M, 2 layers (GPUs)
    torchrun --nproc-per-node 2 -m bench.packed --seq-lens 1M --methods untied --layers 4
    torchrun --nproc-per-node 2 -m bench.packed --device cpu --model tiny --seq-lens 1K \
        --long-doc 256 --short-median 32 --layers 1                   # CPU smoke form

The window is a realistic long-tailed mix (`long_tailed_lengths`): about --long-share of its tokens
in documents of --long-doc to 1.5 x --long-doc tokens (default >= 256K), the rest in documents
whose lengths are log-normal around --short-median (default 3K tokens), in random order, the last
one cut by the window's end. The same tokens are then trained per method, each a full training
step through train.py's own functions at --stack 5's memory techniques (FSDP, checkpointing +
offload, tiling) with Ulysses (02) or Untied Ulysses (05):
  - dense: one causal document per window (what training without --documents does);
  - documents: the window's documents (data.Documents: positions, labels, boundaries), through
    FlashAttention-4's varlen launch where it passed its check (kernels.varlen_works), else the
    per-document loop over the dense kernel (--attn-kernel picks it);
  - documents_loop (only when varlen runs): the same documents through the per-document loop
    over FA4's dense kernel, one launch per document and head chunk.
Recorded per row: step time (median of the steps after the first), tokens/s per GPU, the peak
allocated, the attention kernel. Document masking does less attention work (sum of L_i^2
instead of S^2), so `attention_work` gives that fraction: a documents step at the same speed as
dense is a kernel that stopped being efficient. A first `kernel` part times attention alone
(forward + backward of one rank's heads after the exchange, all S tokens) per masking, without
the step. Depth: --layers (default 2) like bench/throughput.py; say so next to the number.
"""

import argparse
import dataclasses
import importlib
import math
import time
from pathlib import Path

import torch

from support import kernels
import model as llama
from bench.report import (default_out_dir, end_distributed, peak_and_times, refuse_without_gpu,
                          release, synchronize, within_budget, write_result)
from bench.step import with_layers
from support.data import documents_in_windows, parse_tokens

train = importlib.import_module("train")
GiB = 2**30


def long_tailed_lengths(seq_len: int, long_doc: int, long_share: float, short_median: int,
                        seed: int = 0) -> list[int]:
    """Document lengths filling seq_len + 1 tokens: long documents of [long_doc, 1.5 long_doc)
    tokens up to `long_share` of the window, short ones log-normal (sigma 1) around
    `short_median`, at least 16 tokens, in random order; the last cut at the window's end."""
    generator = torch.Generator().manual_seed(seed)
    window = seq_len + 1
    lengths, long_tokens = [], 0
    while long_tokens + long_doc <= long_share * window:
        n = long_doc + int(torch.randint(0, max(1, long_doc // 2), (), generator=generator))
        lengths.append(n)
        long_tokens += n
    filled = long_tokens
    while filled < window:
        n = int(short_median * math.exp(float(torch.randn((), generator=generator))))
        n = max(16, min(n, long_doc - 1))
        lengths.append(n)
        filled += n
    order = torch.randperm(len(lengths), generator=generator).tolist()
    lengths = [lengths[i] for i in order]
    ends = torch.tensor(lengths).cumsum(0)
    last = int((ends < window).sum())  # the document the window's end falls in
    return lengths[:last] + [window - int(ends[last - 1]) if last else window]


def packed_window(vocab_size: int, lengths: list[int], seed: int = 0):
    """Random tokens (1, S + 1) and the Documents of `lengths` over them."""
    window = sum(lengths)
    tokens = torch.randint(0, vocab_size, (1, window), generator=torch.Generator().manual_seed(seed))
    starts = torch.zeros(1, window, dtype=torch.bool)
    starts[0, torch.tensor([0] + lengths[:-1]).cumsum(0)] = True
    return tokens, documents_in_windows(tokens, starts, torch.zeros(1, dtype=torch.int64))


def attention_work(cu_seqlens) -> float:
    """Causal attention work of the documents as a fraction of one dense window's."""
    lengths = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
    return sum(n * (n + 1) for n in lengths) / (sum(lengths) * (sum(lengths) + 1))


def time_kernel(args, sp, seq_len, cu_seqlens, device, dtype, repeats) -> dict:
    """Attention alone, forward + backward, one rank's heads over all tokens: dense vs documents."""
    heads, kv_heads = args.n_heads // sp, max(args.n_kv_heads // sp, 1)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, seq_len, h, args.head_dim, device=device, dtype=dtype,
                           generator=generator).requires_grad_() for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(1, seq_len, heads, args.head_dim, device=device, dtype=dtype, generator=generator)
    row = {}
    for masking in maskings(q, k):
        def run():
            kernels.use_varlen(masking != "documents_loop")
            cu = None if masking == "dense" else cu_seqlens
            kernels.causal_attention(q, k, v, cu_seqlens=cu).backward(grad)
        row[f"{masking}_ms"] = 1e3 * peak_and_times(run, device, repeats)["time_s"]
        row[f"{masking}_over_dense"] = row[f"{masking}_ms"] / row["dense_ms"]
    kernels.use_varlen(True)
    return row


def maskings(q, k) -> list[str]:
    """dense, documents (FA4's varlen launch where it passed its check, else the loop), and
    with varlen also documents_loop (the per-document loop over the same dense kernel)."""
    return ["dense", "documents"] + (["documents_loop"] if kernels.varlen_works(q, k) else [])


def time_step(cfg, tokens, documents, steps) -> dict:
    """Build the model for `cfg`, run `steps` training steps: median time after the first."""
    rt = train.setup_runtime(cfg)
    model = optimizer = None
    try:
        model = train.build_model(cfg, rt)
        optimizer = train.make_optimizer(model, cfg)
        times, peak = [], None
        for _ in range(steps):
            synchronize(rt.device)
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            loss = train.forward_backward(model, tokens, rt, documents=documents)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(rt.device)
            times.append(time.perf_counter() - start)
            if rt.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated() / GiB
        step = sorted(times[1:] or times)[len(times[1:] or times) // 2]
        row = {"status": "ok", "step_time_s": step, "step_times_s": times, "peak_gib": peak,
               "tokens_per_s_per_gpu": cfg.seq_len / step / rt.world * rt.dp, "loss": float(loss)}
    except torch.OutOfMemoryError as error:
        row = {"status": "OOM", "error": str(error).split("\n")[0]}
    del model, optimizer
    release(rt.device)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", nargs="+", default=["128K", "512K", "1M"])
    parser.add_argument("--methods", nargs="+", default=["ulysses", "untied"])
    parser.add_argument("--layers", type=int, default=2, help="model depth (0: the preset's)")
    parser.add_argument("--steps", type=int, default=2, help="steps per row; those after the first are timed")
    parser.add_argument("--long-doc", default="256K", help="shortest long document")
    parser.add_argument("--long-share", type=float, default=0.5, help="share of tokens in long documents")
    parser.add_argument("--short-median", default="3K", help="median short document")
    parser.add_argument("--kernel-repeats", type=int, default=3)
    parser.add_argument("--attn-kernel", choices=kernels.KERNELS, default="auto",
                        help="the dense kernel the per-document loop runs (fa4, cudnn, ...)")
    parser.add_argument("--budget-s", type=float, default=540, help="skip what starts after this")
    parser.add_argument("--name", default=None)
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    refuse_without_gpu("packed.py", opts.model, opts.device,
                       "python -m bench.packed --device cpu --model tiny --seq-lens 1K --long-doc "
                       "256 --short-median 32 --layers 1")
    started = time.perf_counter()
    dtype = "bfloat16" if opts.device == "cuda" else "float32"
    model_name = with_layers(opts.model, opts.layers or None)
    args = llama.get_model_args(model_name)
    base = train.Config(model=model_name, device=opts.device, dtype=dtype, steps=0, fsdp=True,
                        checkpoint=True, offload=True, tile_mlp=True, tile_loss=True, tile_norm=True,
                        attn_kernel=opts.attn_kernel)
    rt = train.setup_runtime(train.resolve_techniques(dataclasses.replace(base, seq_len=1024)))
    long_doc, short_median = parse_tokens(opts.long_doc), parse_tokens(opts.short_median)
    result = {"what": "packed documents (document-masked attention) vs dense causal, same window",
              "model": opts.model, "layers": args.n_layers, "dtype": dtype,
              "stack": "fsdp, checkpoint, offload, tile_mlp, tile_loss, tile_norm + the method",
              "mix": {"long_doc": long_doc, "long_share": opts.long_share,
                      "short_median": short_median},
              "kernel": ("documents: FlashAttention-4's varlen launch where it passed its check "
                         "(kernels.varlen_works), else the per-document loop over the dense kernel; "
                         "documents_loop: that loop (kernels.document_attention)"),
              "attention_kernel": kernels.attention_kernel_name(rt.device, getattr(torch, dtype),
                                                                args.head_dim),
              "rows": []}
    name = opts.name or f"packed_{opts.model}_{rt.world}gpu" + ("" if opts.device == "cuda" else "_cpu")
    out_dir = Path(opts.out or default_out_dir())
    for seq_len in map(parse_tokens, opts.seq_lens):
        lengths = long_tailed_lengths(seq_len, long_doc, opts.long_share, short_median)
        tokens, documents = packed_window(args.vocab_size, lengths)
        mix = {"seq_len": seq_len, "documents": documents.count,
               "longest": max(lengths), "at_least_long_doc": sum(n >= long_doc for n in lengths),
               "median_length": sorted(lengths)[len(lengths) // 2],
               "attention_work": attention_work(documents.cu_seqlens)}
        if within_budget(started, opts.budget_s, rt.device):
            row = {**mix, "part": "kernel", **time_kernel(
                args, rt.world, seq_len, documents.cu_seqlens, rt.device, getattr(torch, dtype),
                opts.kernel_repeats)}
            result["rows"].append(row)
            if rt.rank == 0:
                print(row, flush=True)
        heads = args.n_heads // rt.world, max(args.n_kv_heads // rt.world, 1)  # Ulysses' per rank
        probe_q, probe_k = (torch.empty(1, 1, h, args.head_dim, device=rt.device,
                                        dtype=getattr(torch, dtype)) for h in heads)
        for method in opts.methods:
            for masking in maskings(probe_q, probe_k):
                row = {**mix, "part": "step", "method": method, "masking": masking}
                if not within_budget(started, opts.budget_s, rt.device):
                    result["rows"].append({**row, "status": "skipped (time budget)"})
                    continue
                cfg = train.resolve_techniques(dataclasses.replace(
                    base, seq_len=seq_len, ulysses=method == "ulysses", untied=method == "untied"))
                kernels.use_varlen(masking != "documents_loop")
                row.update(time_step(cfg, tokens, None if masking == "dense" else documents,
                                     opts.steps))
                kernels.use_varlen(True)
                result["rows"].append(row)
                if rt.rank == 0:
                    print({k: v for k, v in row.items() if k != "step_times_s"}, flush=True)
                    write_result(name, result, out_dir, announce=False)
    result["wall_s"] = time.perf_counter() - started
    if rt.rank == 0:
        write_result(name, result, out_dir)
        steps = {(r["seq_len"], r["method"], r["masking"]): r for r in result["rows"]
                 if r["part"] == "step" and r.get("status") == "ok"}
        print(f"\n{'tokens':>8} {'docs':>6} {'work':>6} {'method':>8} {'masking':>15} "
              f"{'dense s':>9} {'docs s':>9} {'docs/dense':>11}")
        for (seq_len, method, masking), r in steps.items():
            dense = steps.get((seq_len, method, "dense"))
            if masking != "dense" and dense:
                print(f"{seq_len:>8} {r['documents']:>6} {r['attention_work']:>6.2f} {method:>8} "
                      f"{masking:>15} {dense['step_time_s']:>9.2f} {r['step_time_s']:>9.2f} "
                      f"{r['step_time_s'] / dense['step_time_s']:>11.3f}")
    end_distributed()


if __name__ == "__main__":
    main()
