"""eval.py - does the model use its context? Loss by position and passkey retrieval, sharded.

The forward that trains at 3M tokens evaluates at 3M tokens: this file builds the model exactly
as train.py does (the same flags, support/runtime.py's `setup_runtime`, train.py's
`build_model`: FSDP, Ulysses or Untied Ulysses, tiling) and runs it forward only, under
torch.no_grad, with far less memory than a training step (no gradients, no optimizer state, no
activations kept for backward; the planner's `--eval` mode counts it). Activation checkpointing
and offload (03) only serve backward, so they are switched off here. 04's tiled functions and
05's autograd Function run their forward loops unchanged under no_grad (tests/test_eval.py runs
every stack level).

    python eval.py --save-dir runs/tiny                      # loss by position, tiny model, CPU
    torchrun --nproc-per-node 2 eval.py --stack 5 --seq-len 1K --windows 4 --bucket-start 64
    python eval.py --compare before.json after.json          # both curves on one chart
    python eval.py --task passkey --lengths 256,1K --depths 0,0.5,1 --trials 8

Loss by position (--task loss): held-out windows of a token file (--data, --windows,
--first-window: windows are consecutive seq_len + 1 token slices, as in training), each token's
cross-entropy summed into buckets of its position on a log scale: [0, 1K), [1K, 2K), [2K, 4K),
..., up to the length (--bucket-start sets the first edge). Every rank knows the positions of its
shard (02's shard_sequence), so it adds its tokens' losses into the buckets and one all_reduce
gives the totals. Per-token losses come from the model's `token_scores` seam (model.py; 04 tiles
it with the loss under --tile-loss, so seq x vocab logits never exist). Buckets follow
positions: with packed documents (--documents, --doc-sep, as in training) attention stays inside
each document and the buckets are positions within the document, each document scored as if
alone (a document's last token has no target). A window that starts inside a document gives that
document's tokens their true rotary positions (as training does) but only the context from the
window's start: they are bucketed by that visible context (`context_positions`), so a deep bucket
holds only tokens that saw that much of their document. Writes JSON and a PNG curve.

Passkey retrieval (--task passkey), at the token level: a random key (--key-len ids from
--alphabet) follows a marker (--marker-ids) at a chosen depth inside filler (--filler-ids,
repeated); the sequence ends with the marker again and the model must continue with the key.
With --tokenizer DIR (a Hugging Face tokenizer) the filler, marker and digits are that
tokenizer's ids of an English filler sentence, " The pass key is" and "0".."9".
Greedy decoding of the key after a long prefix needs no KV cache and no second long forward:
one sharded forward of prefix + key, teacher-forced, checks at every key position that the
argmax equals the key token. That is exactly greedy decoding: greedy's first token is the argmax
after the prefix, and as long as every earlier token matched the key, greedy's input is the
teacher-forced input, so its next token is the same argmax. The key comes out exactly iff every
key position's argmax is right (the first mismatch is where greedy would go wrong; positions
after it differ from greedy's, so only the all-correct count is the retrieval accuracy; the JSON
also gives the first token's). Accuracy over lengths x depths (--trials keys each), as a heatmap.

Weights: random init, or the model of a run's saved training state (--save-dir: its newest
complete save, or a step_N folder), on any number of ranks whatever the saving layout
(saved_state.load_model_state), or a Hugging Face folder (--init-from, through train.py's
build_model like every other flag).

On GPUs (commands for the GPU machine; the planner gives the longest length per level):

    python plan.py --eval --model llama3-8b --seq-len max --gpus 8 --gpu-mem 80GiB
    torchrun --nproc-per-node 8 eval.py --model llama3-8b --stack 5 --seq-len 3M \\
        --data val.bin --data-dtype uint32 --windows 2 --save-dir runs/8b --out eval_3m.json
    torchrun --nproc-per-node 8 eval.py --task passkey --model llama3-8b --stack 5 \\
        --lengths 128K,512K,1M,2M,3M --depths 0,0.25,0.5,0.75,1 --trials 2 --save-dir runs/8b
The JSON records seconds per million tokens (median forward) and the peak GPU memory. The
planner's forward-only counts (within 1% of a 6M-token forward measured on 2 H200s:
docs/calibration.md), with the margin every plan keeps, put Llama-3-8B's longest evaluation at
--stack 5 at 14.9M tokens on 8 x 80 GiB (training: 5.8M) and 7.1M on 2 H200s (training: 1.0M
with their 256 GiB of host memory, which the offload fills first: --host-mem 256GiB).
"""

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from model import IGNORE_INDEX, token_scores as model_token_scores
import plan
import train
from support import config, paths, saved_state
from support.config import Config, model_args
from support.data import TokenData, parse_tokens, stack_documents
from support.lessons import tiling, ulysses_sp
from support.runtime import read_machine, setup_runtime
from support.errors import exit_on_error, out_of_memory_names


FILLER_TEXT = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
               "There and back again. ")


# ---------------------------------------------------------------------------------------------
# Building: train.py's runtime and model, forward only, weights from a saved state.
# ---------------------------------------------------------------------------------------------

def eval_config(cfg: Config) -> Config:
    """cfg without 03: checkpointing and offload keep activations for a backward that never
    comes."""
    return replace(cfg, checkpoint=False, offload=False, checkpoint_layers=None, resume=False)


def build(cfg: Config):
    """(runtime, model, saved state's meta or None) for evaluation."""
    rt = setup_runtime(cfg)
    machine = read_machine(cfg)  # None on the CPU: 05's default U = P there
    if machine and cfg.untied and cfg.head_chunk is None:  # the fewest stages whose forward fits
        cfg.head_chunk = plan.fewest_stages_that_fit(cfg, rt.world, machine.gpu_mem,
                                                     forward_only=True)
    model = train.build_model(cfg, rt)
    if cfg.tile_loss:
        tile_token_scores(model, cfg.loss_tile_tokens)
    meta = saved_state.load_model_state(cfg.save_dir, model) if cfg.save_dir else None
    model.eval()
    return rt, model, meta


def tile_token_scores(model, tile_tokens: int | None = None) -> None:
    """The model's token_scores seam (each token's loss and greedy prediction), tiled like 04's
    loss (--tile-loss): `tile_tokens` tokens at a time, the loss's tiles by default, so seq x
    vocab logits never exist."""
    model.token_scores = partial(tiled_token_scores, model, tile_tokens=tile_tokens)


def tiled_token_scores(model, h: torch.Tensor, labels: torch.Tensor,
                       tile_tokens: int | None = None) -> torch.Tensor:
    """model.Transformer.token_scores, `tile_tokens` tokens at a time: the same tiles as 04's
    loss, one output row of 2 per token. Under torch.no_grad 04's shared forward loop
    (tiled_over_tokens) runs alone: no recompute."""
    tokens, flat_labels = h.reshape(-1, h.shape[-1]), labels.reshape(-1)
    weights = (model.norm.weight, model.lm_head.weight)  # read now: FSDP
    tile = tiling.loss_tile_size(weights[1].shape[0], tokens.shape[0], tile_tokens)
    scores_of_tile = partial(model_token_scores, eps=model.norm.eps,
                             logit_scores=model.logit_scores)
    scores = tiling.tiled_over_tokens(scores_of_tile, tokens,
                                      (flat_labels,), weights, tile, sum_tiles=False)
    return scores.view(*labels.shape, 2)


@torch.no_grad()
def token_scores(model, tokens: torch.Tensor, rt, labels=None, documents=None):
    """One forward of this rank's shard of `tokens` (B, S + 1): (scores (B, S/P, 2) with each
    token's loss and greedy prediction, its labels, its positions: global, or within its
    document when `documents` (data.Documents of tokens: positions and boundaries) is given)."""
    tokens = tokens.to(rt.device)
    positions = cu_seqlens = None
    if documents is not None:
        positions, cu_seqlens = documents.position_ids.to(rt.device), documents.cu_seqlens
    input_ids, labels, positions = ulysses_sp.shard_sequence(
        tokens, rt.sp_rank, rt.sp, None if labels is None else labels.to(rt.device), positions,
        rt.token_order(tokens.shape[1] - 1))
    with out_of_memory_names("forward"):
        scores = model(input_ids, positions, labels, per_token=True, cu_seqlens=cu_seqlens)
    return scores.float(), labels, positions


def all_reduce(t: torch.Tensor, rt) -> torch.Tensor:
    if rt.world > 1:
        dist.all_reduce(t)
    return t


def synchronize(rt):
    if rt.device.type == "cuda":
        torch.cuda.synchronize()


def seconds_per_million(times: list[float], tokens_per_forward: int) -> float:
    """Median forward time (the first left out when there are more: compile, warm-up) per 2^20
    tokens of the whole sequence (all ranks' shards together; the batch of every data rank)."""
    kept = sorted(times[1:] if len(times) > 1 else times)
    return kept[len(kept) // 2] / (tokens_per_forward / 2**20)


# ---------------------------------------------------------------------------------------------
# Loss by position
# ---------------------------------------------------------------------------------------------

def bucket_edges(seq_len: int, first: int = 1024) -> list[int]:
    """[0, first, 2 first, 4 first, ..., seq_len]: log-scale position buckets up to the length."""
    edges = [0]
    edge = first
    while edge < seq_len:
        edges.append(edge)
        edge *= 2
    return edges + [seq_len]


def bucket_sums(losses, positions, labels, edges) -> torch.Tensor:
    """(2, buckets) fp64: summed loss and token count per bucket of `positions` (non-ignored
    labels only). Positions are whatever position_ids say: global, or per document."""
    boundaries = torch.tensor(edges[1:-1], device=positions.device)
    index = torch.bucketize(positions.flatten(), boundaries, right=True)
    keep = (labels.flatten() != IGNORE_INDEX).double()
    sums = torch.zeros(2, len(edges) - 1, dtype=torch.float64, device=positions.device)
    sums[0].index_add_(0, index, losses.flatten().double() * keep)
    sums[1].index_add_(0, index, keep)
    return sums


def context_positions(cu_seqlens, batch: int, seq_len: int) -> torch.Tensor:
    """(batch, seq_len): each token's index within its document's part of the window, the
    context it can attend to (module docstring), from the global boundaries."""
    bounds = torch.tensor(cu_seqlens)
    starts = torch.repeat_interleave(bounds[:-1], bounds[1:] - bounds[:-1])
    return (torch.arange(batch * seq_len) - starts).view(batch, seq_len)


def window_source(cfg, vocab_size: int):
    """window(i) -> (1, seq_len + 1) ids of window i (data.py's windows; 'synthetic' too)."""
    data = TokenData(replace(cfg, batch_size=1), vocab_size, 0, 1)
    return data, data.batch


def loss_by_position(model, cfg, rt, windows: int, first_window: int = 0,
                     bucket_start: int = 1024) -> dict:
    """Mean loss per position bucket over `windows` windows from `first_window` on. Each data-
    parallel rank takes every dp-th batch of windows; ranks run the same number of forwards
    (a rank without a window left runs one with every label ignored). With --documents the
    positions are within each document (module docstring)."""
    args = model_args(cfg)
    data, window = window_source(cfg, args.vocab_size)
    if data.tokens is not None:
        available = data.tokens.numel() // (cfg.seq_len + 1)
        if first_window + windows > available:
            raise ValueError(f"{cfg.data} holds {available} "
                             f"window{'s' if available != 1 else ''} of {cfg.seq_len + 1:,} "
                             f"tokens; --first-window {first_window} + --windows {windows} is more")
    edges = bucket_edges(cfg.seq_len, bucket_start)
    totals = torch.zeros(2, len(edges) - 1, dtype=torch.float64, device=rt.device)
    per_forward = rt.dp * cfg.batch_size
    times = []
    for step in range(math.ceil(windows / per_forward)):
        indices = [(step * rt.dp + rt.dp_rank) * cfg.batch_size + j for j in range(cfg.batch_size)]
        numbers = [first_window + min(i, windows - 1) for i in indices]
        rows = [window(n) for n in numbers]
        tokens = torch.cat(rows)
        documents = (stack_documents([data.documents(n, row) for n, row in zip(numbers, rows)])
                     if cfg.documents else None)
        labels = (tokens[:, 1:] if documents is None else documents.labels).clone()
        labels[torch.tensor(indices) >= windows] = IGNORE_INDEX  # padding rows
        synchronize(rt)
        start = time.perf_counter()
        scores, local_labels, positions = token_scores(model, tokens, rt, labels, documents)
        if documents is not None:  # bucket by the context each token saw (module docstring)
            visible = context_positions(documents.cu_seqlens, *labels.shape).to(rt.device)
            positions = ulysses_sp.shard_sequence(tokens, rt.sp_rank, rt.sp, None, visible,
                                               rt.token_order(tokens.shape[1] - 1))[2]
        totals += bucket_sums(scores[..., 0], positions, local_labels, edges)
        synchronize(rt)
        times.append(time.perf_counter() - start)
    all_reduce(totals, rt)
    sums, counts = totals.cpu().tolist()
    return {"task": "loss", "seq_len": cfg.seq_len, "windows": windows,
            "positions": "within each document" if cfg.documents else "in the window",
            "first_window": first_window, "data": cfg.data, "edges": edges,
            "buckets": [{"start": a, "end": b, "tokens": int(n), "mean_loss": s / n if n else None}
                        for a, b, s, n in zip(edges[:-1], edges[1:], sums, counts)],
            "mean_loss": sum(sums) / max(sum(counts), 1), "forward_seconds": times,
            "s_per_million_tokens": seconds_per_million(times, per_forward * cfg.seq_len)}


# ---------------------------------------------------------------------------------------------
# Passkey retrieval
# ---------------------------------------------------------------------------------------------

def passkey_tokens(length: int, depth: float, key, filler, marker, prefix=()):
    """(ids (length + 1,), labels (length,), needle_key_start): prefix, filler with marker + key
    inserted at `depth` (0 = right after the prefix, 1 = right before the end), then marker +
    key as the last tokens. Labels are ignored except the key's last len(key) positions: the
    inputs of a forward are ids[:-1], so the model predicts each key token from everything
    before it (teacher forcing: see the module docstring)."""
    key, filler, marker, prefix = list(key), list(filler), list(marker), list(prefix)
    needle = marker + key
    haystack = length + 1 - len(prefix) - len(marker) - len(key)
    if haystack < len(needle):
        raise ValueError(f"a passkey sequence of {length} tokens cannot hold the prefix, the "
                         f"needle and the question ({len(prefix) + 2 * len(needle)} tokens)")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depths are fractions between 0 and 1, got {depth}")
    start = round(depth * (haystack - len(needle)))
    body = [filler[i % len(filler)] for i in range(haystack)]
    body[start:start + len(needle)] = needle
    ids = torch.tensor(prefix + body + marker + key)
    labels = torch.full((length,), IGNORE_INDEX)
    labels[-len(key):] = ids[-len(key):]
    return ids, labels, len(prefix) + start + len(marker)


def passkey_ids(opts) -> dict:
    """filler, marker, alphabet (ids a key is drawn from) and prefix: from the flags, or from a
    Hugging Face tokenizer (--tokenizer). Read when the flags are (parse_eval_args): a flag
    that does not parse, or a tokenizer that does not load, is named before any work."""
    if opts.tokenizer:
        return tokenizer_ids(opts.tokenizer)
    low, colon, high = opts.alphabet.partition(":")
    try:
        low, high = int(low), int(high)
    except ValueError:
        colon = ""
    if not colon or not 0 <= low < high:
        raise ValueError(f"--alphabet takes key ids LOW:HIGH with 0 <= LOW < HIGH (the ids LOW "
                         f"to HIGH - 1, e.g. 16:26), got {opts.alphabet!r}")
    return {"filler": id_list("--filler-ids", opts.filler_ids),
            "marker": id_list("--marker-ids", opts.marker_ids),
            "alphabet": list(range(low, high)), "prefix": []}


def id_list(flag: str, text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",")]
    except ValueError:
        ids = [-1]
    if min(ids) < 0:
        raise ValueError(f"{flag} takes token ids >= 0 separated by commas (e.g. 4,5,6), "
                         f"got {text!r}")
    return ids


def tokenizer_ids(folder: str) -> dict:
    """passkey_ids of a Hugging Face tokenizer folder: the ids of FILLER_TEXT, of the marker
    " The pass key is" and of the digits 0-9 (one token each), its BOS first."""
    if not Path(folder).is_dir():
        raise ValueError(f"--tokenizer {folder}: " + ("a file" if Path(folder).exists() else
                         "no such folder") + " (it takes a Hugging Face tokenizer folder)")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # OSError, ValueError, the tokenizers library's own errors
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"--tokenizer {folder}: not a tokenizer transformers can load "
                         f"({reason})") from None
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    digits = [encode(str(d)) for d in range(10)]
    if any(len(d) != 1 for d in digits):
        raise ValueError("--tokenizer: the digits 0-9 must be one token each")
    return {"filler": encode(FILLER_TEXT), "marker": encode(" The pass key is"),
            "alphabet": [d[0] for d in digits],
            "prefix": [] if tok.bos_token_id is None else [tok.bos_token_id]}


def passkey_vocabulary(opts, vocab_size: int) -> dict:
    """opts' passkey ids (passkey_ids, read with the flags), which must lie in the model's
    vocabulary."""
    vocabulary = opts.vocabulary
    used = [i for ids in vocabulary.values() for i in ids]
    if max(used) >= vocab_size or min(used) < 0:
        source = (f"--tokenizer {opts.tokenizer}" if opts.tokenizer
                  else "--alphabet, --filler-ids and --marker-ids")
        raise ValueError(f"passkey token ids must lie in [0, {vocab_size}) for this model; "
                         f"those of {source} reach {max(used)}"
                         + (" (a tokenizer of another model?)" if opts.tokenizer else ""))
    return vocabulary


def random_key(key_len: int, alphabet, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return [alphabet[i] for i in torch.randint(len(alphabet), (key_len,), generator=generator)]


def passkey_grid(model, cfg, rt, lengths, depths, trials: int, key_len: int, vocabulary: dict,
                 seed: int = 0) -> dict:
    """Exact-match (greedy) and first-token accuracy for every length x depth, `trials` keys
    each (trial t uses the same key in every cell). Trials are spread over data-parallel ranks,
    each sequence over the sequence-parallel ranks; one all_reduce per cell."""
    exact, first, speed = [], [], {}
    per_forward = rt.dp * cfg.batch_size
    for length in lengths:
        exact.append([])
        first.append([])
        times = []
        for depth in depths:
            counts = torch.zeros(trials, 2, dtype=torch.float64, device=rt.device)
            for step in range(math.ceil(trials / per_forward)):
                rows = [(step * rt.dp + rt.dp_rank) * cfg.batch_size + j
                        for j in range(cfg.batch_size)]
                made = [passkey_tokens(length, depth,
                                       random_key(key_len, vocabulary["alphabet"],
                                                  seed * 1_000_003 + min(t, trials - 1)),
                                       vocabulary["filler"], vocabulary["marker"],
                                       vocabulary["prefix"])
                        for t in rows]
                tokens = torch.stack([m[0] for m in made])
                labels = torch.stack([m[1] for m in made])
                synchronize(rt)
                start = time.perf_counter()
                scores, local_labels, positions = token_scores(model, tokens, rt, labels)
                synchronize(rt)
                times.append(time.perf_counter() - start)
                correct = ((scores[..., 1] == local_labels)
                           & (local_labels != IGNORE_INDEX)).double()
                first_key_position = (positions == length - key_len).double()
                for j, t in enumerate(rows):
                    if t < trials:
                        counts[t, 0] += correct[j].sum()
                        counts[t, 1] += (correct[j] * first_key_position[j]).sum()
            all_reduce(counts, rt)
            exact[-1].append(float((counts[:, 0] == key_len).double().mean()))
            first[-1].append(float(counts[:, 1].mean()))
        speed[length] = seconds_per_million(times, per_forward * length)
    return {"task": "passkey", "lengths": list(lengths), "depths": list(depths), "trials": trials,
            "key_len": key_len, "alphabet_size": len(vocabulary["alphabet"]),
            "chance": len(vocabulary["alphabet"]) ** -key_len, "accuracy": exact,
            "first_token_accuracy": first, "s_per_million_tokens": speed}


# ---------------------------------------------------------------------------------------------
# Charts: every result comes with its PNG
# ---------------------------------------------------------------------------------------------

def pyplot():
    """matplotlib's pyplot (drawing to files), or a ValueError that says what to install:
    evaluate() asks before any work, so a long run never ends without its chart."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ValueError("matplotlib is not installed, and eval.py draws every result as a PNG: "
                         "pip install matplotlib (it is in requirements.txt)") from error
    return plt


def tokens_text(n: int) -> str:
    if n == 0:
        return "0"
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def plot_losses(results: list[dict], path):
    """Mean loss per position bucket, one line per result (two runs or checkpoints)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for result in results:
        kept = [b for b in result["buckets"] if b["tokens"]]
        ax.plot([b["end"] for b in kept], [b["mean_loss"] for b in kept], "-o",
                label=result.get("label") or "run")
    ends = sorted({b["end"] for r in results for b in r["buckets"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(ends, [tokens_text(n) for n in ends])
    within = {r.get("positions") for r in results} == {"within each document"}
    ax.set_xlabel(("position within its document" if within else "token position")
                  + " (bucket end; buckets double from the first)")
    ax.set_ylabel("mean cross-entropy (nats)")
    ax.set_title("loss by position")
    ax.legend(fontsize=8)
    plt.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_passkey(result: dict, path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(1.2 * len(result["depths"]) + 3,
                                    0.6 * len(result["lengths"]) + 2))
    image = ax.imshow(result["accuracy"], vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(result["depths"])), [f"{d:g}" for d in result["depths"]])
    ax.set_yticks(range(len(result["lengths"])), [tokens_text(n) for n in result["lengths"]])
    for i, row in enumerate(result["accuracy"]):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center",
                    color="w" if value < 0.6 else "k")
    ax.set_xlabel("depth of the key in the context")
    ax.set_ylabel("length (tokens)")
    ax.set_title(f"passkey retrieval, greedy exact match ({result.get('label') or 'run'})")
    fig.colorbar(image)
    plt.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

FLAG_GROUPS = (config.add_model_flags, config.add_rotary_flags, config.add_step_flags,
               config.add_process_flags, config.add_data_flags, config.add_document_flags,
               config.add_technique_flags)  # shared with train.py; and --save-dir, read

# Each task's own flags and their defaults: given with the other task, they are refused (they
# would be ignored). They default to None in the parser, so that a flag given is told apart.
TASK_FLAGS = {"loss": {"windows": 4, "first_window": 0, "bucket_start": "1K"},
              "passkey": {"lengths": None, "depths": "0,0.25,0.5,0.75,1", "trials": 4,
                          "key_len": 4, "alphabet": "16:26", "filler_ids": "4,5,6,7,8,9,10,11",
                          "marker_ids": "1,2,3", "tokenizer": None}}


def parse_eval_args(argv):
    """(eval options, Config): eval's own flags, and those it shares with train.py."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], allow_abbrev=False,
        epilog="03's --checkpoint, --offload, --checkpoint-layers and --keep-attention serve a "
               "backward: accepted (as in a training command) and switched off. Longest "
               "lengths: python plan.py --eval")
    evaluation = parser.add_argument_group("evaluation")
    evaluation.add_argument("--task", choices=["loss", "passkey"], default="loss")
    evaluation.add_argument("--windows", type=int, help="loss: windows of --seq-len + 1 tokens")
    evaluation.add_argument("--first-window", type=int, help="loss: skip the windows before it")
    evaluation.add_argument("--bucket-start", help="loss: the first bucket edge (default 1K)")
    evaluation.add_argument("--lengths", help="passkey: e.g. 4K,128K,1M (default --seq-len)")
    evaluation.add_argument("--depths", help="passkey: fractions of the context")
    evaluation.add_argument("--trials", type=int, help="passkey: keys per length x depth")
    evaluation.add_argument("--key-len", type=int, help="passkey: key tokens")
    evaluation.add_argument("--alphabet", help="passkey: key ids LOW:HIGH (no tokenizer)")
    evaluation.add_argument("--filler-ids", help="passkey: repeated filler ids")
    evaluation.add_argument("--marker-ids", help="passkey: ids before the key (twice)")
    evaluation.add_argument("--tokenizer", help="passkey: a Hugging Face tokenizer directory")
    evaluation.add_argument("--label", default=None, help="the run's name on charts")
    evaluation.add_argument("--out", default=None,
                            help="JSON file path (the PNG goes next to it, ending in .png)")
    evaluation.add_argument("--compare", nargs="+", default=None, metavar="JSON",
                            help="no run: draw these loss results on one chart (--out: the PNG)")
    evaluation.add_argument("--overwrite-out", action="store_true",
                            help="replace an existing --out (and its PNG)")
    for add_flags in FLAG_GROUPS:
        add_flags(parser)
    config.add_saved_state_flags(parser, writes=False)
    opts = parser.parse_args(argv)
    opts.out, opts.chart = output_paths(opts)
    if opts.compare:
        return opts, None
    check_task_flags(opts)
    cfg = eval_config(config.config_from_flags(opts))
    if opts.task == "passkey" and cfg.documents:
        raise ValueError("--documents / --doc-sep apply to --task loss: a passkey sequence is one "
                         "document")
    if opts.task == "passkey":
        try:
            opts.lengths = [parse_tokens(n) for n in (opts.lengths or str(cfg.seq_len)).split(",")]
        except ValueError as error:
            raise ValueError(f"--lengths: {error}") from None
        opts.depths = depth_list(opts.depths)
        cfg.seq_len = max(opts.lengths)
        opts.vocabulary = passkey_ids(opts)
    if min(opts.windows, opts.trials, opts.key_len) < 1 or opts.first_window < 0:
        raise ValueError("--windows, --trials and --key-len must be >= 1, --first-window >= 0")
    opts.bucket_start = parse_tokens(opts.bucket_start)
    return opts, cfg


CHART_SUFFIXES = (".png", ".pdf", ".svg")  # what matplotlib writes by the name alone


def output_paths(opts) -> tuple[Path, Path]:
    """(the result's JSON, its chart), or (the chart, the chart) with --compare. --out is a file
    path; a run's chart is that path ending in .png. Refused before any work: an empty --out, a
    folder, a path whose folder cannot be made, an --out whose chart would replace it, and an
    earlier result (unless --overwrite-out) or a --compare input, never replaced."""
    if opts.out is not None and not opts.out.strip():
        raise ValueError("--out is empty: give the result's file path (e.g. eval.json)")
    default = (Path(opts.compare[0]).with_name("compare.png") if opts.compare
               else Path(f"eval_{opts.task}.json"))
    out = Path(opts.out) if opts.out else default
    if opts.out and (opts.out.endswith(("/", os.sep)) or out.is_dir()):
        raise ValueError(f"--out {opts.out} is a folder: --out is the result's file path, e.g. "
                         f"{out / default.name}")
    chart = out if opts.compare else out.with_suffix(".png")
    if opts.compare and out.suffix.lower() not in CHART_SUFFIXES:
        raise ValueError(f"--out {out} with --compare is the chart's path: end it in "
                         f"{', '.join(CHART_SUFFIXES)} (e.g. {out.with_suffix('.png')})")
    if not opts.compare and out.suffix.lower() == ".png":
        raise ValueError(f"--out {out} is the JSON result's path, and its chart is that path "
                         f"ending in .png: give a .json path, e.g. {out.with_suffix('.json')}")
    paths.check_can_write("--out", str(out))
    for path in dict.fromkeys([out, chart]):
        if opts.compare and any(path.exists() and path.samefile(p) for p in opts.compare
                                if Path(p).exists()):
            raise ValueError(f"--out {path} is one of the --compare results: choose another")
        if path.is_dir():
            raise ValueError(f"{path} is a folder: choose another --out")
        if path.exists() and not opts.overwrite_out:  # an earlier result: never replaced unasked
            raise ValueError(f"{path} exists: choose another --out, or --overwrite-out")
    return out, chart


def check_task_flags(opts) -> None:
    """Fill in the defaults of --task's own flags; refuse those of the other task (and a
    token file for passkey, the ids flags with --tokenizer): each would be silently ignored."""
    other = "passkey" if opts.task == "loss" else "loss"
    given = [name for name in TASK_FLAGS[other] if getattr(opts, name) is not None]
    if opts.task == "passkey":
        given += [name for name in ("data", "data_dtype")
                  if getattr(opts, name) != getattr(config.DEFAULTS, name)]
    if given:
        why = ("passkey makes its own sequences of filler, marker and key ids: it reads no "
               "windows of --data"
               if opts.task == "passkey" else "--task loss reads windows of --data")
        raise ValueError(f"{', '.join(flag_name(n) for n in given)} "
                         f"appl{'ies' if len(given) == 1 else 'y'} to --task {other}, not to "
                         f"--task {opts.task}: {why}")
    if opts.task == "passkey" and opts.tokenizer:
        given = [name for name in ("alphabet", "filler_ids", "marker_ids")
                 if getattr(opts, name) is not None]
        if given:
            raise ValueError(f"{', '.join(flag_name(n) for n in given)} and --tokenizer: the "
                             f"tokenizer gives the passkey ids (its digits, filler text and "
                             f"marker); give one or the other")
    for task in TASK_FLAGS.values():
        for name, default in task.items():
            if getattr(opts, name) is None:
                setattr(opts, name, default)


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def depth_list(text: str) -> list[float]:
    try:
        depths = [float(d) for d in text.split(",")]
    except ValueError:
        depths = [-1.0]
    if not all(0 <= d <= 1 for d in depths):  # nan too
        raise ValueError(f"--depths takes fractions of the context from 0 to 1 separated by "
                         f"commas (e.g. 0,0.5,1), got {text!r}")
    return depths


def run(opts, cfg) -> dict:
    rt, model, meta = build(cfg)
    if opts.task == "passkey":
        for length in opts.lengths:  # every length splits evenly over the sequence ranks
            try:
                ulysses_sp.check_sequence_split(length, rt.sp, rt.ring)
            except ValueError as error:
                raise ValueError(f"passkey length {length}: {error}") from None
        vocabulary = passkey_vocabulary(opts, model.args.vocab_size)
        result = passkey_grid(model, cfg, rt, opts.lengths, opts.depths, opts.trials, opts.key_len,
                              vocabulary, cfg.seed)
    else:
        result = loss_by_position(model, cfg, rt, opts.windows, opts.first_window,
                                  opts.bucket_start)
    result.update(label=opts.label or (meta["path"] if meta else cfg.init_from or "random init"),
                  checkpoint=meta and {"path": meta["path"], "step": meta["step"]},
                  config=asdict(cfg), world_size=rt.world, sp=rt.sp, ring=rt.ring, dp=rt.dp,
                  head_chunk=cfg.head_chunk, torch=torch.__version__,
                  peak_gpu_mem_gib=(round(torch.cuda.max_memory_allocated() / 2**30, 3)
                                    if rt.device.type == "cuda" else None))
    if rt.rank == 0:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=1) + "\n")
        (plot_passkey if opts.task == "passkey" else plot_losses)(
            *([result] if opts.task == "passkey" else [[result]]), opts.chart)
        print(summary(result) + f"\nwrote {opts.out} and {opts.chart}")
    return result


def summary(result: dict) -> str:
    if result["task"] == "loss":
        timing = (f" ({result['s_per_million_tokens']:.2f} s per million tokens)"
                  if "s_per_million_tokens" in result else "")  # a computed bound has none
        windows = result["windows"]
        lines = [f"{result['label']}: mean loss {result['mean_loss']:.4f} over {windows} "
                 f"window{'s' if windows != 1 else ''} of {result['seq_len']:,} tokens{timing}"]
        lines += [f"  [{tokens_text(b['start']):>5}, {tokens_text(b['end']):>5})  "
                  + (f"{b['mean_loss']:.4f}" if b["tokens"] else "-") for b in result["buckets"]]
        return "\n".join(lines)
    trials, key_len = result["trials"], result["key_len"]
    lines = [f"{result['label']}: passkey exact match ({trials} key{'s' if trials != 1 else ''} of "
             f"{key_len} token{'s' if key_len != 1 else ''}, chance {result['chance']:.2g}); rows: "
             f"length, columns: depth "
             + " ".join(f"{d:g}" for d in result["depths"])]
    lines += [f"  {tokens_text(n):>6}  " + " ".join(f"{a:.2f}" for a in row)
              for n, row in zip(result["lengths"], result["accuracy"])]
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    exit_on_error(lambda: evaluate(argv))


def evaluate(argv):
    opts, cfg = parse_eval_args(argv)
    pyplot()  # the chart's library, before any work
    if opts.compare:
        results = []
        for p in opts.compare:
            try:
                results.append(json.loads(Path(p).read_text()))
            except (OSError, json.JSONDecodeError) as error:
                raise ValueError(f"--compare: cannot read {p}: {error}") from error
            if "buckets" not in results[-1]:
                raise ValueError(f"--compare: {p} is not a loss-by-position result (--task loss)")
        labels = [r.get("label") or Path(p).stem for p, r in zip(opts.compare, results)]
        for path, result, label in zip(opts.compare, results, labels):
            # two runs of the same name (two random inits, one checkpoint dir): add the file
            result["label"] = label if labels.count(label) == 1 else f"{label} ({Path(path).name})"
        edges = {tuple(b["end"] for b in r["buckets"]) for r in results}
        if len(edges) > 1:  # drawn anyway, but the points are not the same positions
            print("note: these results have different position buckets (--bucket-start or "
                  "--seq-len differ): compare the lines with care")
        opts.chart.parent.mkdir(parents=True, exist_ok=True)
        plot_losses(results, opts.chart)
        print(f"wrote {opts.chart}")
        return
    run(opts, cfg)


if __name__ == "__main__":
    main()
