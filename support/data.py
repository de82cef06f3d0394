"""data.py - token ids for training: synthetic sequences or a flat binary file of ids, and where
the documents packed into them begin and end.

A batch is (batch_size, seq_len + 1) ids for one data-parallel rank: seq_len inputs and, shifted
by one, seq_len labels (02 shifts before it shards the sequence). The data position is the step
number, so resuming a run needs nothing more than the step.

Packed documents (--documents). Real data is many documents concatenated into one stream, each
ending with a separator token (--doc-sep, the token file's sidecar, or the model's EOS id) and/or
listed in a boundary index next to the token file. Windows over the stream are the same as
without documents; inside a window each document stands on its own. `Documents` is all the
model needs for that, computed here, before the sequence is sharded:
  - position_ids restart at 0 at each document start (a window that starts inside a document
    continues that document's positions), so a shard gets its positions without a gather;
  - labels are IGNORE_INDEX at each document's last token: its next token belongs to another
    document (the global token mean counts only real targets);
  - cu_seqlens, the document boundaries as global token offsets over the whole batch: the
    attention kernels (kernels.py) keep each document's attention inside it.
Files next to a token file `data.bin` (prepare_data.py writes both):
  data.bin.json   {"dtype", "vocab_size", "separator_id", "documents", "tokens"}
  data.bin.docs   flat little-endian int64: the offset of every document's first token
"""

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

IGNORE_INDEX = -100  # model.IGNORE_INDEX (not imported: data.py needs no model)
DTYPES = {"uint16": 2, "uint32": 4}


def parse_tokens(text: str) -> int:
    """'4096', '128K', '3M' -> tokens (K = 1024, M = 1024*1024). A count that is not a whole
    number of tokens ('100.7'), not finite ('inf') or not positive is refused, not rounded."""
    typed = str(text).strip()  # the messages echo it as typed
    scale = {"K": 2**10, "M": 2**20}.get(typed[-1:].upper(), 1)
    number = typed[:-1] if scale > 1 else typed
    try:
        value = float(number) * scale
    except ValueError:
        raise ValueError(f"cannot read a token count from {typed!r} (try 4096, 128K or 3M)")
    if not math.isfinite(value) or value != int(value):
        raise ValueError(f"a token count must be a whole, finite number, got {typed!r}")
    if value <= 0:
        raise ValueError(f"the token count must be positive, got {typed!r}")
    return int(value)


def sidecar_path(path: str) -> str:
    return path + ".json"


def boundary_path(path: str) -> str:
    return path + ".docs"


@dataclass
class Documents:
    """Packed documents of a batch of windows (B, S + 1), before sharding: labels (B, S) with
    IGNORE_INDEX at each document's last token, position_ids (B, S) restarting at each document,
    and cu_seqlens, the global offset of every document start over the B * S inputs taken as
    one stream, then B * S (a tuple of ints; row b starts at b * S)."""
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: tuple

    @property
    def count(self) -> int:
        return len(self.cu_seqlens) - 1

    def rows(self, rows: slice) -> "Documents":
        """The packed documents of some rows of the batch (a micro-batch): each row starts a
        document, so the boundaries inside them, shifted to the first row, are theirs."""
        seq_len = self.labels.shape[1]
        first, last = rows.start * seq_len, rows.stop * seq_len
        return Documents(self.labels[rows], self.position_ids[rows],
                         tuple(b - first for b in self.cu_seqlens if first <= b <= last))


def documents_in_windows(windows: torch.Tensor, starts: torch.Tensor,
                         first_positions: torch.Tensor) -> Documents:
    """`Documents` of windows (B, S + 1) whose tokens starting a document are marked in
    `starts` (B, S + 1) bool; first_positions (B,): the position of each window's first token
    within its document (0 where the window starts with a document)."""
    batch, seq_len = windows.shape[0], windows.shape[1] - 1
    labels = windows[:, 1:].clone()
    labels[starts[:, 1:]] = IGNORE_INDEX  # the next token starts another document
    index = torch.arange(seq_len).expand(batch, -1)
    # The start of each token's document within the window (0 for the one it starts inside).
    begins = torch.cummax(torch.where(starts[:, :seq_len], index, 0), dim=1).values
    first = torch.where(starts[:, 0], 0, first_positions)[:, None]
    positions = index - begins + torch.where(begins == 0, first, 0)
    bounds = []
    for row in range(batch):
        inside = starts[row, 1:seq_len].nonzero().flatten() + 1
        bounds += [row * seq_len] + (inside + row * seq_len).tolist()
    return Documents(labels, positions, tuple(bounds) + (batch * seq_len,))


def stack_documents(parts: list[Documents]) -> Documents:
    """One batch from the Documents of single windows (B = 1 each), in row order: row b's
    boundaries shift by b x S (eval.py gathers its windows one by one)."""
    seq_len = parts[0].labels.shape[1]
    bounds = [0]
    for row, part in enumerate(parts):
        bounds += [row * seq_len + int(b) for b in part.cu_seqlens[1:]]
    return Documents(torch.cat([p.labels for p in parts]),
                     torch.cat([p.position_ids for p in parts]), tuple(bounds))


class TokenData:
    """Batches of (batch_size, seq_len + 1) token ids for one data-parallel rank.

    'synthetic': each sequence is an arithmetic progression modulo the vocabulary with a random
    start and stride, so a model that learns to attend to the previous two tokens can predict it
    (the loss goes down within a few steps); with documents, each window is a run of such
    progressions of random lengths (log-uniform up to the window), each ending with the
    separator. A file: flat little-endian uint16 or uint32 ids, read through a memory map;
    consecutive windows of seq_len + 1 tokens. `documents(step, tokens)`: where the documents of
    that batch are (None without --documents).
    """

    def __init__(self, cfg, vocab_size: int, dp_rank: int, dp: int, eos_id: int | None = None):
        self.cfg, self.vocab_size, self.dp_rank, self.dp = cfg, vocab_size, dp_rank, dp
        synthetic = cfg.data == "synthetic"
        info = {} if synthetic else read_sidecar(cfg.data, vocab_size)
        dtype = check_dtype(cfg, info)
        self.tokens = None if synthetic else open_token_file(cfg.data, dtype, cfg.seq_len + 1)
        if not synthetic:  # every id once, now: not when its window comes, steps later
            scan_token_file(cfg.data, dtype, vocab_size)
        if self.tokens is not None and info.get("tokens") not in (None, self.tokens.numel()):
            raise ValueError(f"{sidecar_path(cfg.data)} says {info['tokens']} tokens, but "
                             f"{cfg.data} holds {self.tokens.numel()}: the files do not match")
        self.packed = bool(cfg.documents)
        # The file says where its documents are, but training was not asked to keep them apart.
        self.documents_ignored = not self.packed and not synthetic and (
            info.get("separator_id") is not None or os.path.isfile(boundary_path(cfg.data)))
        self.separator = self.starts = None
        if self.packed:
            index = None if synthetic else boundary_path(cfg.data)
            has_index = index is not None and os.path.isfile(index)
            self.separator = document_separator(cfg, info, eos_id, vocab_size, has_index)
            if synthetic and self.separator is None:
                raise ValueError("synthetic documents end with a separator: pass --doc-sep ID")
            if has_index:
                self.starts = open_boundary_file(index, self.tokens, self.separator, info)

    def window_starts(self, step: int) -> list[int]:
        """Offsets into the token file of this rank's windows at `step`."""
        first = (step * self.dp + self.dp_rank) * self.cfg.batch_size  # global sample index
        window = self.cfg.seq_len + 1
        n_windows = self.tokens.numel() // window
        return [(i % n_windows) * window for i in range(first, first + self.cfg.batch_size)]

    def batch(self, step: int) -> torch.Tensor:
        cfg = self.cfg
        if self.tokens is None:
            return self.synthetic(step)
        window = cfg.seq_len + 1
        rows = [self.tokens[start:start + window] for start in self.window_starts(step)]
        batch = torch.stack(rows).to(torch.int64)
        if int(batch.max()) >= self.vocab_size:
            raise ValueError(f"{cfg.data} holds token id {int(batch.max())}, but the model's "
                             f"vocabulary has {self.vocab_size} entries")
        return batch

    def synthetic(self, step: int) -> torch.Tensor:
        """This rank's rows of step `step`, each drawn from its own generator seeded by its
        global sample index: the global batch is the same at any data-parallel layout."""
        cfg = self.cfg
        first = (step * self.dp + self.dp_rank) * cfg.batch_size  # global sample index
        generators = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + first + row)
                      for row in range(cfg.batch_size)]
        window = cfg.seq_len + 1
        if not self.packed:
            rows = []
            for generator in generators:
                start = torch.randint(0, self.vocab_size, (1,), generator=generator)
                stride = torch.randint(1, 17, (1,), generator=generator)
                rows.append((start + stride * torch.arange(window)) % self.vocab_size)
            return torch.stack(rows)
        rows = torch.empty(cfg.batch_size, window, dtype=torch.int64)
        for row, generator in enumerate(generators):
            filled = 0
            while filled < window:
                length = int(math.exp(torch.rand((), generator=generator) * math.log(window))) + 1
                take = min(length, window - filled)
                start = torch.randint(0, self.vocab_size, (), generator=generator)
                stride = torch.randint(1, 17, (), generator=generator)
                # Progressions over the vocabulary without the separator, which ends the document.
                doc = (start + stride * torch.arange(length)) % (self.vocab_size - 1)
                doc += doc >= self.separator
                doc[-1] = self.separator
                rows[row, filled:filled + take] = doc[:take]
                filled += take
        return rows

    def documents(self, step: int, tokens: torch.Tensor) -> Documents | None:
        """`Documents` of `tokens` = batch(step) (None without --documents): from the boundary
        index when the token file has one, else from the separator tokens."""
        if not self.packed:
            return None
        sep, window = self.separator, tokens.shape[1]
        if self.tokens is None:  # synthetic: every window starts with a document
            starts = torch.zeros_like(tokens, dtype=torch.bool)
            starts[:, 0] = True
            starts[:, 1:] = tokens[:, :-1] == sep
            return documents_in_windows(tokens, starts, torch.zeros(len(tokens), dtype=torch.int64))
        offsets = self.window_starts(step)
        starts = torch.zeros_like(tokens, dtype=torch.bool)
        first_positions = []
        for row, offset in enumerate(offsets):
            if self.starts is not None:
                lo, hi = np.searchsorted(self.starts, [offset, offset + window])
                starts[row, torch.from_numpy(self.starts[lo:hi] - offset)] = True
                begin = int(self.starts[np.searchsorted(self.starts, offset, side="right") - 1])
            else:
                starts[row, 1:] = tokens[row, :-1] == sep
                begin = previous_separator(self.tokens, offset, sep) + 1
            first_positions.append(offset - begin)
        starts[:, 0] = torch.tensor(first_positions) == 0
        return documents_in_windows(tokens, starts, torch.tensor(first_positions))


def previous_separator(tokens: torch.Tensor, end: int, separator: int, chunk: int = 1 << 16) -> int:
    """The offset of the last `separator` before `end` in `tokens` (-1: none, the stream's first
    document), read backwards a chunk at a time: as far as the document is long."""
    while end > 0:
        begin = max(0, end - chunk)
        hits = (tokens[begin:end] == separator).nonzero()
        if len(hits):
            return begin + int(hits[-1])
        end = begin
    return -1


def read_sidecar(path: str, vocab_size: int) -> dict:
    """The token file's JSON sidecar (prepare_data.py), checked against the model; {} if none."""
    side = sidecar_path(path)
    if not os.path.isfile(side):
        return {}
    try:
        with open(side) as f:
            info = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read {side}: {error}") from error
    if info.get("vocab_size") is not None and info["vocab_size"] > vocab_size:
        raise ValueError(f"{path} was tokenized with a vocabulary of {info['vocab_size']} ids "
                         f"({side}), more than the model's {vocab_size}")
    return info


def check_dtype(cfg, info: dict) -> str:
    """--data-dtype, else the sidecar's, else uint16; a contradiction between them is an error."""
    given, recorded = cfg.data_dtype, info.get("dtype")
    if given and recorded and given != recorded:
        raise ValueError(f"--data-dtype {given}, but {sidecar_path(cfg.data)} says the ids are "
                         f"{recorded}")
    dtype = given or recorded or "uint16"
    if dtype not in DTYPES:
        raise ValueError(f"token dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def document_separator(cfg, info: dict, eos_id, vocab_size: int, has_index: bool) -> int | None:
    """The token that ends a document: --doc-sep, else the sidecar's, else the model's EOS id;
    None only when a boundary index says where documents start. ValueError otherwise, or when it
    is not a token of the vocabulary."""
    given, recorded = cfg.doc_sep, info.get("separator_id")
    if given is not None and recorded is not None and given != recorded:
        raise ValueError(f"--doc-sep {given}, but {sidecar_path(cfg.data)} says the documents "
                         f"were separated with {recorded}")
    separator = next((s for s in (given, recorded, eos_id) if s is not None), None)
    if separator is None:
        if has_index:
            return None
        raise ValueError(f"--documents needs to know where documents end: the model preset "
                         f"{cfg.model!r} has no EOS id, and there is no --doc-sep, no separator "
                         f"in a sidecar and no boundary index ({boundary_path(cfg.data)})")
    if not 0 <= separator < vocab_size:
        raise ValueError(f"the document separator id {separator} is outside the model's "
                         f"vocabulary [0, {vocab_size})")
    return separator


def open_boundary_file(path: str, tokens: torch.Tensor, separator: int | None, info: dict):
    """Document starts (int64 numpy array) from a boundary index, checked against the token file:
    starting at 0, strictly rising, inside the file, as many as the sidecar says, and each
    preceded by the separator (when there is one)."""
    nbytes = os.path.getsize(path)
    if nbytes == 0 or nbytes % 8:
        raise ValueError(f"boundary file {path!r} has {nbytes} bytes, not a positive number of "
                         f"int64 offsets")
    starts = np.fromfile(path, dtype="<i8")
    n_tokens = tokens.numel()
    problem = None
    if starts[0] != 0:
        problem = f"its first document starts at {starts[0]}, not 0"
    elif (np.diff(starts) <= 0).any():
        problem = "its offsets do not rise strictly"
    elif starts[-1] >= n_tokens:
        problem = f"it has a document starting at {starts[-1]}, past the {n_tokens} tokens"
    elif info.get("documents") not in (None, len(starts)):
        problem = f"it lists {len(starts)} documents, the sidecar {info['documents']}"
    elif separator is not None and len(starts) > 1:
        before = tokens[torch.from_numpy(starts[1:] - 1)]
        wrong = (before != separator).nonzero()
        if len(wrong):
            at = int(starts[1 + int(wrong[0])])
            problem = (f"the document at {at} does not follow the separator {separator} (token "
                       f"{at - 1} is {int(tokens[at - 1])})")
    if problem:
        raise ValueError(f"boundary file {path!r} does not match the token file: {problem}")
    return starts


def open_token_file(path: str, dtype_name: str, min_tokens: int) -> torch.Tensor:
    """Memory-map a flat binary token file, checking it can give at least one sequence."""
    if os.path.isdir(path):
        raise ValueError(f"data file {path!r} is a directory; --data takes one flat binary file "
                         f"of {dtype_name} token ids (or synthetic)")
    if not os.path.isfile(path):
        raise ValueError(f"data file {path!r} does not exist (use --data synthetic or a path to "
                         f"a flat binary file of {dtype_name} token ids)")
    itemsize = DTYPES[dtype_name]
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


SCAN_CHUNK = 1 << 26  # tokens per read: 128 MiB of uint16; a GB file takes a few seconds


def scan_token_file(path: str, dtype_name: str, vocab_size: int) -> None:
    """Read every id once at start, so a bad file fails now and not at the step that reaches it:
    an id outside the vocabulary, or uint32 ids read as uint16 (no sidecar says the dtype).
    Small little-endian uint32 ids read as uint16 come out as (id, 0, id, 0, ...): almost every
    odd position is 0 while the even ones are not, which real uint16 text almost never is."""
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
