"""data.py - token ids for training: synthetic sequences or a flat binary file of ids.

A batch is (batch_size, seq_len + 1) ids for one data-parallel rank: seq_len inputs and, shifted
by one, seq_len labels (02 shifts before it shards the sequence). The data position is the step
number, so resuming a run needs nothing more than the step.
"""

import json
import math
import os

import numpy as np
import torch


def parse_tokens(text: str) -> int:
    """'4096', '128K', '3M' -> tokens (K = 1024, M = 1024*1024). A count that is not a whole
    number of tokens ('100.7'), not finite ('inf') or not positive is refused, not rounded."""
    text = str(text).strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"cannot read a token count from {text!r} (try 4096, 128K or 3M)")
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"a token count must be a whole, finite number, got {text!r}")
    if value <= 0:
        raise ValueError(f"the token count must be positive, got {text!r}")
    return int(value)


class TokenData:
    """Batches of (batch_size, seq_len + 1) token ids for one data-parallel rank.

    'synthetic': each sequence is an arithmetic progression modulo the vocabulary with a random
    start and stride, so a model that learns to attend to the previous two tokens can predict it
    (the loss goes down within a few steps). A file: flat little-endian uint16 or uint32 ids
    (its sidecar <file>.json says which), read through a memory map and scanned once at start;
    consecutive windows of seq_len + 1 tokens.
    """

    def __init__(self, cfg, vocab_size: int, dp_rank: int, dp: int):
        self.cfg, self.vocab_size, self.dp_rank, self.dp = cfg, vocab_size, dp_rank, dp
        self.tokens = None
        if cfg.data != "synthetic":
            dtype_name = token_dtype(cfg.data, cfg.data_dtype, vocab_size)
            self.tokens = open_token_file(cfg.data, dtype_name, cfg.seq_len + 1)
            scan_token_file(cfg.data, dtype_name, vocab_size)

    def batch(self, step: int) -> torch.Tensor:
        cfg = self.cfg
        first = (step * self.dp + self.dp_rank) * cfg.batch_size  # global sample index
        if self.tokens is None:
            generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + first)
            start = torch.randint(0, self.vocab_size, (cfg.batch_size, 1), generator=generator)
            stride = torch.randint(1, 17, (cfg.batch_size, 1), generator=generator)
            return (start + stride * torch.arange(cfg.seq_len + 1)) % self.vocab_size
        window = cfg.seq_len + 1
        n_windows = self.tokens.numel() // window
        rows = [self.tokens[(i % n_windows) * window:(i % n_windows + 1) * window]
                for i in range(first, first + cfg.batch_size)]
        return torch.stack(rows).to(torch.int64)  # every id was checked at start (scan_token_file)


def open_token_file(path: str, dtype_name: str, min_tokens: int) -> torch.Tensor:
    """Memory-map a flat binary token file, checking it can give at least one sequence."""
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a directory; --data takes one flat binary file "
                         f"of {dtype_name} token ids (or synthetic)")
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist (use --data synthetic or a path to "
                         f"a flat binary file of {dtype_name} token ids)")
    itemsize = {"uint16": 2, "uint32": 4}[dtype_name]
    nbytes = os.path.getsize(path)
    if nbytes == 0:
        raise ValueError(f"data file {path!r} is empty")
    if nbytes % itemsize:
        raise ValueError(f"data file {path!r} has {nbytes} bytes, not a whole number of "
                         f"{dtype_name} tokens ({itemsize} bytes each); is --data-dtype right?")
    n_tokens = nbytes // itemsize
    if n_tokens < min_tokens:
        raise ValueError(f"data file {path!r} holds {n_tokens} tokens, fewer than one sequence "
                         f"needs ({min_tokens} = --seq-len + 1)")
    try:
        return torch.from_file(path, shared=False, size=n_tokens, dtype=getattr(torch, dtype_name))
    except (OSError, RuntimeError) as error:
        raise ValueError(f"cannot read data file {path!r}: {error}") from error


# ---------------------------------------------------------------------------------------------
# Is this file what we think it is? A wrong dtype trains on garbage without any error.
# ---------------------------------------------------------------------------------------------

def sidecar_path(path: str) -> str:
    return path + ".json"


def token_dtype(path: str, flag: str | None, vocab_size: int) -> str:
    """The dtype to read `path` with: its sidecar <path>.json ({"dtype": ..., "vocab_size": ...},
    written by whoever tokenized it) when present, else --data-dtype, else uint16. A sidecar that
    disagrees with --data-dtype, or a vocabulary larger than the model's, is an error."""
    sidecar = sidecar_path(path)
    if not os.path.isfile(sidecar):
        return flag or "uint16"
    try:
        with open(sidecar) as f:
            meta = json.load(f)
        recorded = meta["dtype"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read {sidecar!r} (expected JSON like "
                         f'{{"dtype": "uint32", "vocab_size": 128256}}): {error!r}') from error
    if recorded not in ("uint16", "uint32"):
        raise ValueError(f"{sidecar!r} names dtype {recorded!r}; uint16 or uint32 are supported")
    if flag and flag != recorded:
        raise ValueError(f"--data-dtype {flag}, but {sidecar!r} records {recorded}; drop "
                         f"--data-dtype or fix the sidecar")
    data_vocab = meta.get("vocab_size")
    if data_vocab is not None and data_vocab > vocab_size:
        raise ValueError(f"{sidecar!r} records a vocabulary of {data_vocab} ids, but the model's "
                         f"has {vocab_size}: tokenized for another model?")
    return recorded


SCAN_CHUNK = 1 << 26  # tokens per read: 128 MiB of uint16; a GB file takes a few seconds


def scan_token_file(path: str, dtype_name: str, vocab_size: int) -> None:
    """Read every id once at start, so a bad file fails now and not at the step that reaches it:
    an id outside the vocabulary, or uint32 ids read as uint16. Small little-endian uint32 ids
    read as uint16 come out as (id, 0, id, 0, ...): almost every odd position is 0 while the even
    ones are not, which real uint16 text almost never is."""
    ids = np.memmap(path, dtype=np.dtype(dtype_name).newbyteorder("<"), mode="r")
    zeros = [0, 0]  # zeros at even, odd positions
    for start in range(0, len(ids), SCAN_CHUNK):  # SCAN_CHUNK is even: positions keep parity
        chunk = ids[start:start + SCAN_CHUNK]
        if int(chunk.max()) >= vocab_size:
            where = start + int(np.argmax(chunk >= vocab_size))
            raise ValueError(f"{path} holds token id {int(ids[where])} at position {where}, but "
                             f"the model's vocabulary has {vocab_size} entries (is --data-dtype "
                             f"{dtype_name} right? is the data tokenized for this model?)")
        zeros[0] += int(np.count_nonzero(chunk[0::2] == 0))
        zeros[1] += int(np.count_nonzero(chunk[1::2] == 0))
    pairs = len(ids) // 2
    if dtype_name == "uint16" and pairs >= 16 and zeros[1] > 0.9 * pairs and zeros[0] < 0.5 * pairs:
        raise ValueError(f"{path} read as uint16 has 0 at {zeros[1] / pairs:.0%} of the odd "
                         f"positions: it looks like uint32 ids; pass --data-dtype uint32 (or "
                         f"record the dtype in {sidecar_path(path)!r})")
