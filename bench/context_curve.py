"""Does a trained model use a million tokens of context? A token file that needs it.

No text can be downloaded on the GPU machine, and random tokens say nothing about context, so
the file is made of random chunks (--chunk tokens, ids below --vocab-size) that recur. A chunk
seen earlier in the window is predictable from the context alone - after its first token, copy
what followed last time - and a chunk not seen before is not predictable at all (ln vocabulary
per token).

The training windows (--train-windows of --train-len + 1 tokens) each draw their chunks from
their own pool of --train-pool fresh chunks, so most chunks repeat within a window and nothing
can be memorized across windows: the model can only learn to copy from its context. The
evaluation window (--eval-len + 1 tokens, after them) draws from --eval-pool fresh chunks: the
fraction already seen grows with position (1 - exp(-chunks so far / pool): with the defaults 6%
at 64K tokens, 63% at 1M), so a model that uses all of its context has a loss that keeps falling
to the window's end, and one that stops using it past some length has a loss that flattens there.
--bound writes what an ideal copier would score on that window (reaching anywhere, or --reach
tokens back), in eval.py's format, to draw next to the model's curve.

Copying (a previous-token head feeding a head that matches it) forms from scratch only at short
lengths: at 64K, or at 2K over a pool of 32 chunks, the small preset stays at chance for
thousands of steps; at 512 tokens over 8 chunks of 16 it forms after 500-700 steps. So train
short, then extend (train.py --export-hf, then --init-from), each stage's pool a quarter of its
window (one H200, about 6 minutes in all):

    python -m bench.context_curve /tmp/c512.bin --chunk 16 --train-len 512 --train-windows 32000 \
        --train-pool 8 --eval-windows 0
    python -m bench.context_curve /tmp/c8k.bin --chunk 16 --train-len 8K --train-windows 1200 \
        --train-pool 128 --eval-windows 0
    python -m bench.context_curve /tmp/c64k.bin --chunk 16 --train-len 64K --train-windows 600 \
        --train-pool 1024 --eval-len 1M --eval-pool 16384      # prints eval.py's --first-window
    python train.py --fsdp --model small --seq-len 512 --batch-size 32 --steps 1000 --lr 1e-3 \
        --warmup-steps 100 --data /tmp/c512.bin --export-hf /tmp/m512
    python train.py --fsdp --init-from /tmp/m512 --seq-len 8K --batch-size 4 --steps 300 --lr 1e-3 \
        --warmup-steps 30 --data /tmp/c8k.bin --export-hf /tmp/m8k
    python train.py --fsdp --init-from /tmp/m8k --seq-len 64K --steps 600 --lr 1e-3 \
        --warmup-steps 30 --tile-loss --data /tmp/c64k.bin --export-hf /tmp/m64k
    python eval.py --init-from /tmp/m64k --tile-loss --seq-len 1M --data /tmp/c64k.bin \
        --first-window 38 --windows 1 --out after.json
    python -m bench.context_curve /tmp/c64k.bin --bound bound.json --reach 64K
    python eval.py --compare after.json bound.json --out curve.png

What it showed (docs/results/context_curve_small_1gpu_64k.json, the README's chart): the model
uses its context up to about its training length and not beyond.
"""

import argparse
import importlib
import json
import math
import os

import numpy as np

from data import parse_tokens, sidecar_path

evaluate = importlib.import_module("eval")  # eval.py (its name is also a Python builtin)


def chunk_stream(generator, tokens: int, pool: int, chunk: int, vocab_size: int) -> np.ndarray:
    """`tokens` ids: chunks drawn uniformly, with replacement, from `pool` fresh random chunks."""
    chunks = generator.integers(0, vocab_size, size=(pool, chunk), dtype=np.uint16)
    picks = generator.integers(0, pool, size=-(-tokens // chunk))
    return chunks[picks].reshape(-1)[:tokens]


def write_context_file(path: str, train_len: int, train_windows: int, eval_len: int,
                       eval_windows: int, chunk: int, train_pool: int, eval_pool: int,
                       vocab_size: int, seed: int = 0, overwrite: bool = False) -> int:
    """Write the file (uint16 ids) and its sidecar; return the first evaluation window's index
    at --seq-len eval_len (windows of eval_len + 1 tokens, as eval.py counts them). Refuses to
    write over an existing file or sidecar unless `overwrite`."""
    for name, value, least in (("--train-len", train_len, 1), ("--eval-len", eval_len, 1),
                               ("--chunk", chunk, 1), ("--train-pool", train_pool, 1),
                               ("--eval-pool", eval_pool, 1), ("--train-windows", train_windows, 0),
                               ("--eval-windows", eval_windows, 0), ("--vocab-size", vocab_size, 1)):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if vocab_size > 2**16:
        raise ValueError(f"--vocab-size {vocab_size}: the file holds uint16 ids (at most 65536)")
    for existing in (path, sidecar_path(path)):
        if os.path.exists(existing) and not overwrite:
            raise ValueError(f"{existing} exists: choose another path, or --overwrite to replace it")
    generator = np.random.default_rng(seed)
    train = [chunk_stream(generator, train_len + 1, train_pool, chunk, vocab_size)
             for _ in range(train_windows)]
    first_eval_window = -(-train_windows * (train_len + 1) // (eval_len + 1))
    gap = first_eval_window * (eval_len + 1) - train_windows * (train_len + 1)
    evaluation = [chunk_stream(generator, eval_len + 1, eval_pool, chunk, vocab_size)
                  for _ in range(eval_windows)]
    stream = np.concatenate(train + [np.zeros(gap, dtype=np.uint16)] + evaluation)
    stream.tofile(path)
    with open(sidecar_path(path), "w") as f:
        json.dump({"dtype": "uint16", "vocab_size": vocab_size, "tokens": int(stream.size),
                   "made_by": "bench/context_curve.py", "chunk": chunk, "train_pool": train_pool,
                   "eval_pool": eval_pool, "train_windows": train_windows, "train_len": train_len,
                   "first_eval_window": first_eval_window, "eval_len": eval_len}, f, indent=1)
    return first_eval_window


def copy_bound(path: str, reach: int | None = None, bucket_start: int = 1024) -> dict:
    """Loss by position of an ideal copier on the file's evaluation window, in eval.py's result
    format (so `eval.py --compare` draws it next to a model's). The copier predicts a token for
    sure (loss 0) when its chunk occurred before in the window, at most `reach` tokens back (None:
    anywhere), and it is not the chunk's first token (which chunk comes next is random); every
    other token costs ln(vocabulary), chance. A model's curve against the bound with reach R
    says whether it copies from R tokens back."""
    try:
        with open(sidecar_path(path)) as f:
            meta = json.load(f)
        chunk, seq_len, vocab_size = meta["chunk"], meta["eval_len"], meta["vocab_size"]
        start = meta["first_eval_window"] * (seq_len + 1)  # eval.py's window: seq_len + 1 tokens
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: no sidecar written by bench/context_curve.py ({error})") from error
    window = np.fromfile(path, dtype=np.uint16, count=seq_len + 1, offset=2 * start)
    if window.size < seq_len + 1:
        raise ValueError(f"{path} has no evaluation window (written with --eval-windows 0?)")
    chunks = -(-window.size // chunk)
    back = np.full(chunks, np.inf)  # tokens back to the chunk's previous occurrence
    last = {}
    for index in range(chunks):
        key = window[index * chunk:(index + 1) * chunk].tobytes()
        if key in last and len(key) == 2 * chunk:
            back[index] = (index - last[key]) * chunk
        last[key] = index
    target = np.arange(1, seq_len + 1)  # input position p predicts the token at p + 1
    distance = back[target // chunk]
    copied = (target % chunk != 0) & np.isfinite(distance) & (distance <= (reach or math.inf))
    losses = np.where(copied, 0.0, math.log(vocab_size))
    edges = evaluate.bucket_edges(seq_len, bucket_start)
    bucket = np.searchsorted(np.array(edges[1:-1]), target - 1, side="right")
    sums, counts = (np.bincount(bucket, weights=w, minlength=len(edges) - 1) for w in (losses, None))
    reach_text = "anywhere" if reach is None else f"up to {evaluate.tokens_text(reach)} back"
    return {"task": "loss", "seq_len": seq_len, "windows": 1, "positions": "in the window",
            "first_window": meta["first_eval_window"], "data": path, "edges": edges,
            "buckets": [{"start": a, "end": b, "tokens": int(n), "mean_loss": float(t / n)}
                        for a, b, t, n in zip(edges[:-1], edges[1:], sums, counts)],
            "mean_loss": float(losses.mean()), "label": f"ideal copier, {reach_text}",
            "bound": {"reach": reach, "chunk": chunk, "vocab_size": vocab_size}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path")
    parser.add_argument("--train-len", default="64K")
    parser.add_argument("--train-windows", type=int, default=150)
    parser.add_argument("--eval-len", default="1M")
    parser.add_argument("--eval-windows", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--train-pool", type=int, default=128)
    parser.add_argument("--eval-pool", type=int, default=16384)
    parser.add_argument("--vocab-size", type=int, default=4096, help="the 'small' preset's")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file")
    parser.add_argument("--bound", metavar="JSON", default=None,
                        help="write nothing to PATH: the ideal copier's loss by position on its "
                             "evaluation window, to this JSON (for eval.py --compare)")
    parser.add_argument("--reach", default=None, help="--bound: how far back it copies (default: all)")
    opts = parser.parse_args()
    if opts.bound:
        if os.path.exists(opts.bound) and not opts.overwrite:
            parser.error(f"{opts.bound} exists: choose another path, or --overwrite to replace it")
        try:
            bound = copy_bound(opts.path, None if opts.reach is None else parse_tokens(opts.reach))
        except ValueError as error:
            parser.error(str(error))
        with open(opts.bound, "w") as f:
            json.dump(bound, f, indent=1)
        print(evaluate.summary({**bound, "s_per_million_tokens": 0.0}) + f"\nwrote {opts.bound}")
        return
    try:
        first = write_context_file(opts.path, parse_tokens(opts.train_len), opts.train_windows,
                                   parse_tokens(opts.eval_len), opts.eval_windows, opts.chunk,
                                   opts.train_pool, opts.eval_pool, opts.vocab_size,
                                   overwrite=opts.overwrite)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {opts.path}; " + (f"evaluate with --first-window {first} --windows "
                                     f"{opts.eval_windows}" if opts.eval_windows else
                                     "training windows only (--eval-windows 0)"))


if __name__ == "__main__":
    main()
