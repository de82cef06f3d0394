"""Does a trained model use a million tokens of context? A token file that needs it.

    python -m bench.context_curve /tmp/ctx.bin --train-len 64K --train-windows 500 --eval-len 1M
    torchrun --nproc-per-node 2 train.py --model small --stack 5 --seq-len 64K --steps 500 \
        --data /tmp/ctx.bin --save-dir /tmp/ctx-run
    torchrun --nproc-per-node 2 eval.py --model small --stack 5 --seq-len 1M --data /tmp/ctx.bin \
        --first-window 32 --windows 1 --save-dir /tmp/ctx-run --out after.json

(The first command prints the --first-window that starts past the training windows.) No text
can be downloaded on the GPU machine, and random tokens say nothing about context, so the file
is made of random chunks (--chunk tokens, ids below --vocab-size) that recur. A chunk seen
earlier in the window is predictable from the context alone - after its first token, copy what
followed last time - and a chunk not seen before is not predictable at all (ln vocabulary per
token).

The training windows (--train-windows of --train-len + 1 tokens) each draw their chunks from
their own pool of --train-pool fresh chunks, so most chunks repeat within a window and nothing
can be memorized across windows: the model can only learn to copy from its context. The
evaluation window (--eval-len + 1 tokens, after them) draws from --eval-pool fresh chunks: the
fraction already seen grows with position (1 - exp(-chunks so far / pool): with the defaults 6%
at 64K tokens, 63% at 1M), so a model that uses all of its context has a loss that keeps falling
to the window's end, and one that stops using it past some length has a loss that flattens there.

Not yet found: a training run that learns the copying. The small preset (5.2M parameters) had
not after 400 steps of 64K tokens on an H200 (lr 3e-3: loss 8.32 = ln 4096 throughout, the 1M
curve flat; docs/results/context_curve_small_1gpu.json), nor after 300 steps of 2K on the CPU
over 512 ids; the tiny one not after 3000 steps of 1K (8 chunks of 16 per window). The
training loss falling well below ln vocabulary is the sign to look for before evaluating.
"""

import argparse
import json
import os

import numpy as np

from data import parse_tokens, sidecar_path


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
    opts = parser.parse_args()
    try:
        first = write_context_file(opts.path, parse_tokens(opts.train_len), opts.train_windows,
                                   parse_tokens(opts.eval_len), opts.eval_windows, opts.chunk,
                                   opts.train_pool, opts.eval_pool, opts.vocab_size,
                                   overwrite=opts.overwrite)
    except ValueError as error:
        parser.error(str(error))
    print(f"wrote {opts.path}; evaluate with --first-window {first} --windows {opts.eval_windows}")


if __name__ == "__main__":
    main()
