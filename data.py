"""data.py - token ids for training: synthetic sequences or a flat binary file of ids.

A batch is (batch_size, seq_len + 1) ids for one data-parallel rank: seq_len inputs and, shifted
by one, seq_len labels (02 shifts before it shards the sequence). The data position is the step
number, so resuming a run needs nothing more than the step.
"""

import os

import torch


def parse_tokens(text: str) -> int:
    """'4096', '128K', '3M' -> tokens (K = 1024, M = 1024*1024)."""
    text = str(text).strip().upper()
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise ValueError(f"cannot read a token count from {text!r} (try 4096, 128K or 3M)")
    if value <= 0:
        raise ValueError(f"the token count must be positive, got {text!r}")
    return value


class TokenData:
    """Batches of (batch_size, seq_len + 1) token ids for one data-parallel rank.

    'synthetic': each sequence is an arithmetic progression modulo the vocabulary with a random
    start and stride, so a model that learns to attend to the previous two tokens can predict it
    (the loss goes down within a few steps). A file: flat little-endian uint16 or uint32 ids,
    read through a memory map; consecutive windows of seq_len + 1 tokens.
    """

    def __init__(self, cfg, vocab_size: int, dp_rank: int, dp: int):
        self.cfg, self.vocab_size, self.dp_rank, self.dp = cfg, vocab_size, dp_rank, dp
        self.tokens = None if cfg.data == "synthetic" else open_token_file(
            cfg.data, cfg.data_dtype, cfg.seq_len + 1)

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
        batch = torch.stack(rows).to(torch.int64)
        if int(batch.max()) >= self.vocab_size:
            raise ValueError(f"{cfg.data} holds token id {int(batch.max())}, but the model's "
                             f"vocabulary has {self.vocab_size} entries")
        return batch


def open_token_file(path: str, dtype_name: str, min_tokens: int) -> torch.Tensor:
    """Memory-map a flat binary token file, checking it can give at least one sequence."""
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
