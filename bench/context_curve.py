"""Does a trained model use a million tokens of context? A token file that needs it.

No text can be downloaded on the GPU machine, and random tokens say nothing about context, so
the file is made of random chunks (--chunk tokens, ids below --vocab-size) that recur. A chunk
seen earlier in the window is predictable from the context alone - after its first token, copy
what followed last time - and a chunk not seen before is not predictable at all (ln vocabulary
per token).

The training windows (--train-windows of --train-len + 1 tokens, in PATH) each draw their chunks
from their own pool of --train-pool fresh chunks, so most chunks repeat within a window and
nothing can be memorized across windows: the model can only learn to copy from its context. The
evaluation windows (--eval-len + 1 tokens) go to their own file, NAME.eval.bin, so no number of
training steps reaches them, and draw from --eval-pool fresh chunks: the fraction already seen
grows with position (1 - exp(-chunks so far / pool): with the defaults, chunks of 64, 6% at 64K
tokens and 63% at 1M; with the recipe's chunks of 16, 22% and 98%), so a model that uses all of
its context has a loss that keeps falling to the window's end, and one that stops using it past
some length has a loss that flattens there. --bound writes what an ideal copier would score on
an evaluation file (reaching anywhere, or --reach tokens back), in eval.py's format, to draw
next to the model's curve.

Copying (a previous-token head feeding a head that matches it) forms from scratch only at short
lengths: at 64K, or at 2K over a pool of 32 chunks, the small preset stays at chance for
thousands of steps (the first tries: docs/results/context_curve_small_1gpu.json); at 512 tokens
over 8 chunks of 16 it forms after 500-700 steps. So train short, then extend (train.py
--export-hf, then --init-from), each stage's pool a quarter of its window's chunks (each chunk
recurs about four times per window), and steps x --batch-size = --train-windows (one H200,
about 6 minutes in all):

    python -m bench.context_curve /tmp/c512.bin --chunk 16 --train-len 512 --train-windows 32000 \
        --train-pool 8 --eval-windows 0
    python -m bench.context_curve /tmp/c8k.bin --chunk 16 --train-len 8K --train-windows 1200 \
        --train-pool 128 --eval-windows 0
    python -m bench.context_curve /tmp/c64k.bin --chunk 16 --train-len 64K --train-windows 600 \
        --train-pool 1024 --eval-len 1M --eval-pool 16384      # and /tmp/c64k.eval.bin
    python train.py --fsdp --model small --seq-len 512 --batch-size 32 --steps 1000 --lr 1e-3 \
        --warmup-steps 100 --data /tmp/c512.bin --export-hf /tmp/m512
    python train.py --fsdp --init-from /tmp/m512 --seq-len 8K --batch-size 4 --steps 300 --lr 1e-3 \
        --warmup-steps 30 --data /tmp/c8k.bin --export-hf /tmp/m8k
    python train.py --fsdp --init-from /tmp/m8k --seq-len 64K --steps 600 --lr 1e-3 \
        --warmup-steps 30 --tile-loss --data /tmp/c64k.bin --export-hf /tmp/m64k
    python eval.py --init-from /tmp/m64k --tile-loss --seq-len 1M --data /tmp/c64k.eval.bin \
        --windows 1 --out after.json
    python -m bench.context_curve /tmp/c64k.eval.bin --bound bound.json --reach 64K
    python eval.py --compare after.json bound.json --out curve.png

What it showed (docs/results/context_curve_small_1gpu_64k.json, measured when both parts were
still one file; the chart in docs/results.md): the model uses its context up to about its training
length and not beyond.
"""

import argparse
import importlib
import json
import math
import os

import numpy as np
import torch

from support.data import parse_tokens, sidecar_path

evaluate = importlib.import_module("eval")  # eval.py (its name is also a Python builtin)


def chunk_stream(generator, tokens: int, pool: int, chunk: int, vocab_size: int) -> np.ndarray:
    """`tokens` ids: chunks drawn uniformly, with replacement, from `pool` fresh random chunks."""
    chunks = generator.integers(0, vocab_size, size=(pool, chunk), dtype=np.uint16)
    picks = generator.integers(0, pool, size=-(-tokens // chunk))
    return chunks[picks].reshape(-1)[:tokens]


def eval_path(path: str) -> str:
    """Where the evaluation windows of `path`'s training file go: NAME.eval.bin next to it."""
    root, ext = os.path.splitext(path)
    return f"{root}.eval{ext or '.bin'}"


def write_context_files(path: str, train_len: int, train_windows: int, eval_len: int,
                        eval_windows: int, chunk: int, train_pool: int, eval_pool: int,
                        vocab_size: int, seed: int = 0, overwrite: bool = False) -> list[str]:
    """Write the training windows to `path` and the evaluation windows to `eval_path(path)`
    (uint16 ids, each file with its sidecar; a file is left out when it has no windows), and
    return the paths written. Two files, so that no number of training steps ever reaches the
    held-out windows (train.py wraps around its file). Refuses bad sizes, and an existing file
    or sidecar unless `overwrite`, before writing anything."""
    for name, value, least in (("--train-len", train_len, 1), ("--eval-len", eval_len, 1),
                               ("--chunk", chunk, 1), ("--train-pool", train_pool, 1),
                               ("--eval-pool", eval_pool, 1), ("--train-windows", train_windows, 0),
                               ("--eval-windows", eval_windows, 0),
                               ("--vocab-size", vocab_size, 1)):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if vocab_size > 2**16:
        raise ValueError(f"--vocab-size {vocab_size}: the file holds uint16 ids (at most 65536)")
    if not train_windows and not eval_windows:
        raise ValueError("--train-windows and --eval-windows are both 0: nothing to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a directory: create it first")
    parts = [(part, file) for part, file, windows in (("training", path, train_windows),
                                                      ("evaluation", eval_path(path), eval_windows))
             if windows]
    for _, file in parts:
        for existing in (file, sidecar_path(file)):
            if os.path.exists(existing) and not overwrite:
                raise ValueError(f"{existing} exists: choose another path, or --overwrite to "
                                 f"replace it")
    generator = np.random.default_rng(seed)
    windows = {"training": [chunk_stream(generator, train_len + 1, train_pool, chunk, vocab_size)
                            for _ in range(train_windows)],
               "evaluation": [chunk_stream(generator, eval_len + 1, eval_pool, chunk, vocab_size)
                              for _ in range(eval_windows)]}
    sizes = {"training": (train_len, train_pool), "evaluation": (eval_len, eval_pool)}
    for part, file in parts:
        stream = np.concatenate(windows[part])
        stream.tofile(file)
        window, pool = sizes[part]
        with open(sidecar_path(file), "w") as f:
            json.dump({"dtype": "uint16", "vocab_size": vocab_size, "tokens": int(stream.size),
                       "made_by": "bench/context_curve.py", "part": part, "chunk": chunk,
                       "pool": pool, "seq_len": window, "windows": len(windows[part])}, f, indent=1)
    return [file for _, file in parts]


def copy_bound(path: str, reach: int | None = None, bucket_start: int = 1024) -> dict:
    """Loss by position of an ideal copier on an evaluation file's windows, in eval.py's result
    format (so `eval.py --compare` draws it next to a model's). The copier predicts a token for
    sure (loss 0) when its chunk occurred before in the window, at most `reach` tokens back (None:
    anywhere), and it is not the chunk's first token (which chunk comes next is random); every
    other token costs ln(vocabulary), chance. A model's curve against the bound with reach R
    says whether it copies from R tokens back."""
    try:
        with open(sidecar_path(path)) as f:
            meta = json.load(f)
        part, chunk, seq_len, vocab_size = (meta["part"], meta["chunk"], meta["seq_len"],
                                            meta["vocab_size"])
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: no sidecar written by bench/context_curve.py "
                         f"({error})") from error
    if part != "evaluation":
        raise ValueError(f"{path} holds training windows; the bound is of {eval_path(path)}")
    if not os.path.isfile(path):
        raise ValueError(f"{path} does not exist (its sidecar does)")
    stream = np.fromfile(path, dtype=np.uint16)
    windows = stream.size // (seq_len + 1)
    target = np.arange(1, seq_len + 1)  # input position p predicts the token at p + 1
    edges = evaluate.bucket_edges(seq_len, bucket_start)
    positions, labels = torch.from_numpy(target - 1), torch.zeros(seq_len, dtype=torch.long)
    sums = torch.zeros(2, len(edges) - 1, dtype=torch.float64)  # eval.py's: loss, tokens
    for window in stream[:windows * (seq_len + 1)].reshape(windows, seq_len + 1):
        chunks = -(-window.size // chunk)
        back = np.full(chunks, np.inf)  # tokens back to the chunk's previous occurrence
        last = {}
        for index in range(chunks):
            key = window[index * chunk:(index + 1) * chunk].tobytes()
            if key in last and len(key) == 2 * chunk:
                back[index] = (index - last[key]) * chunk
            last[key] = index
        distance = back[target // chunk]
        copied = (target % chunk != 0) & np.isfinite(distance) & (distance <= (reach or math.inf))
        losses = torch.from_numpy(np.where(copied, 0.0, math.log(vocab_size)))
        sums += evaluate.bucket_sums(losses, positions, labels, edges)
    sums, counts = sums.tolist()
    reach_text = "anywhere" if reach is None else f"up to {evaluate.tokens_text(reach)} back"
    return {"task": "loss", "seq_len": seq_len, "windows": windows, "positions": "in the window",
            "data": path, "edges": edges,
            "buckets": [{"start": a, "end": b, "tokens": int(n), "mean_loss": float(t / n)}
                        for a, b, t, n in zip(edges[:-1], edges[1:], sums, counts)],
            "mean_loss": sum(sums) / sum(counts), "label": f"ideal copier, {reach_text}",
            "bound": {"reach": reach, "chunk": chunk, "vocab_size": vocab_size}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="the training file to write (its evaluation windows go to "
                                     "NAME.eval.bin); with --bound, an evaluation file to read")
    parser.add_argument("--train-len", default="64K")
    parser.add_argument("--train-windows", type=int, default=150)
    parser.add_argument("--eval-len", default="1M")
    parser.add_argument("--eval-windows", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--train-pool", type=int, default=128)
    parser.add_argument("--eval-pool", type=int, default=16384)
    parser.add_argument("--vocab-size", type=int, default=4096, help="the 'small' preset's")
    parser.add_argument("--overwrite", action="store_true", help="replace existing files")
    parser.add_argument("--bound", metavar="JSON", default=None,
                        help="write no tokens: the ideal copier's loss by position on the "
                             "evaluation file PATH, to this JSON (for eval.py --compare)")
    parser.add_argument("--reach", default=None,
                        help="--bound: how far back it copies (default: all)")
    parser.add_argument("--bucket-start", default="1K", help="--bound: the first bucket's end, "
                                                             "as eval.py's --bucket-start")
    opts = parser.parse_args()
    try:
        if opts.bound:
            if os.path.exists(opts.bound) and not opts.overwrite:
                raise ValueError(f"{opts.bound} exists: choose another path, or --overwrite")
            if not os.path.isdir(os.path.dirname(os.path.abspath(opts.bound))):
                raise ValueError(f"the folder of {opts.bound} does not exist")
            bound = copy_bound(opts.path, None if opts.reach is None else parse_tokens(opts.reach),
                               parse_tokens(opts.bucket_start))
            with open(opts.bound, "w") as f:
                json.dump(bound, f, indent=1)
            print(evaluate.summary(bound) + f"\nwrote {opts.bound}")
            return
        if opts.reach is not None:
            raise ValueError("--reach is a setting of --bound")
        train_len, eval_len = parse_tokens(opts.train_len), parse_tokens(opts.eval_len)
        written = write_context_files(opts.path, train_len, opts.train_windows, eval_len,
                                      opts.eval_windows, opts.chunk, opts.train_pool,
                                      opts.eval_pool, opts.vocab_size, overwrite=opts.overwrite)
    except ValueError as error:
        parser.error(str(error))
    if opts.train_windows:
        print(f"wrote {opts.path}: {opts.train_windows:,} training windows (train.py --data "
              f"{opts.path} --seq-len {opts.train_len}; steps x --batch-size past "
              f"{opts.train_windows:,} repeat them)")
    if opts.eval_windows:
        print(f"wrote {written[-1]}: {opts.eval_windows} evaluation window(s) (eval.py --data "
              f"{written[-1]} --seq-len {opts.eval_len} --windows {opts.eval_windows}; "
              f"python -m bench.context_curve {written[-1]} --bound bound.json)")

if __name__ == "__main__":
    main()
