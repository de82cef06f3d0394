"""The picture of 02's exchange: which tokens of which heads each rank holds before and after the
all-to-all that turns "my S/P tokens, all H heads" into "all S tokens, my H/P heads".

    python -m bench.ulysses_diagram --ranks 4 --seq-len 8 --heads 8 --out docs/ulysses_exchange.png

No GPU and no processes: one process plays the P ranks of 02's `all_to_all` on labelled tensors
(B = 1, D = 2 holding each value's token and head). Each rank cuts its tensor with 02's own
pattern (TO_HEADS' first: piece j goes to rank j), piece j of rank r arrives at rank j in slot r
(what all_to_all_single does), and each rank joins what arrived with TO_HEADS' second pattern;
TO_TOKENS, the way back, must give every rank its tensor again. So the picture shows what the
code does. It draws
  (a) before: on each rank its S/P tokens (rows) of all H heads (columns), the heads cut into P
      groups, group j sent to rank j;
  (b) after: on each rank all S tokens of its H/P heads, each row colored by the rank it came
      from: rank j's tokens arrive j-th, so the sequence is in order again.
It also prints both layouts as text.
"""

import argparse
import textwrap
from pathlib import Path

import torch
from einops import rearrange

from support.lessons import ulysses_sp

MAX_RANKS = 8  # past 8 ranks the cells are too small to read


def labelled_shards(seq_len: int, heads: int, ranks: int) -> list[torch.Tensor]:
    """Rank r's (1, S/P, H, 2) shard of the sequence, before the exchange: tokens
    [r*S/P, (r+1)*S/P) of every head, each value the pair (its token, its head)."""
    tokens = torch.arange(seq_len).view(1, seq_len, 1, 1).expand(1, seq_len, heads, 1)
    head_ids = torch.arange(heads).view(1, 1, heads, 1).expand(1, seq_len, heads, 1)
    whole = torch.cat([tokens, head_ids], dim=-1)
    return list(whole.chunk(ranks, dim=1))


def exchange(shards: list[torch.Tensor], patterns) -> list[torch.Tensor]:
    """02's all_to_all for every rank at once, in one process: each rank cuts its tensor with
    patterns[0] (p first: piece j is for rank j), rank j receives piece j of every rank r in
    slot r, and joins them with patterns[1]."""
    ranks = len(shards)
    cut, join = patterns
    sent = [rearrange(x, cut, p=ranks) for x in shards]
    return [rearrange(torch.stack([sent[r][j] for r in range(ranks)]), join) for j in range(ranks)]


def check_shape(ranks: int, seq_len: int, heads: int) -> None:
    if not 1 <= ranks <= MAX_RANKS:
        raise ValueError(f"--ranks must be between 1 and {MAX_RANKS} (got {ranks}): past "
                         f"{MAX_RANKS} ranks the cells are too small to read")
    if seq_len % ranks or heads % ranks:
        raise ValueError(f"--seq-len ({seq_len}) and --heads ({heads}) must both divide by "
                         f"--ranks ({ranks}): Ulysses cuts the tokens and the heads into P parts")


def layouts(ranks: int, seq_len: int, heads: int):
    """(before, after): per rank a (rows, heads, 2) tensor of (token, head) pairs, the exchange
    computed by 02's patterns; checked to be a permutation that TO_TOKENS undoes."""
    check_shape(ranks, seq_len, heads)
    before = labelled_shards(seq_len, heads, ranks)
    after = exchange(before, ulysses_sp.TO_HEADS)
    back = exchange(after, ulysses_sp.TO_TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(back, before)), "TO_TOKENS does not undo TO_HEADS"
    return [x[0] for x in before], [x[0] for x in after]


def print_layouts(before, after) -> None:
    for title, per_rank in (("before (seq_to_heads' input)", before), ("after", after)):
        print(f"{title}:")
        for rank, held in enumerate(per_rank):
            tokens, head_ids = held[:, 0, 0].tolist(), held[0, :, 1].tolist()
            print(f"  rank {rank}: tokens {span(tokens)} x heads {span(head_ids)}")


def span(values: list[int]) -> str:
    """'0-7' for a run of consecutive values, else the list."""
    if values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}-{values[-1]}" if len(values) > 1 else str(values[0])
    return str(values)


def draw(before, after, seq_len: int, heads: int, path: Path) -> None:
    """(a) above (b): one panel per rank, rows = tokens held, columns = heads held."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = len(before)
    width_inches = max(2.6 * ranks + 1.0, 10)
    wrap = lambda text: textwrap.fill(text, int(width_inches * 13.5), subsequent_indent="     ")
    caption = lambda part, text: part.suptitle(wrap(text), x=0.01, ha="left", fontsize=10)
    color = lambda rank: plt.get_cmap("tab10")(rank % 10)
    tokens_per_rank, heads_per_rank = seq_len // ranks, heads // ranks
    heights = [tokens_per_rank + 2.5, seq_len + 2.5]  # rows, plus the caption's and the labels'
    fig = plt.figure(figsize=(width_inches, 0.4 * sum(heights) + 1), layout="constrained")
    before_part, after_part = fig.subfigures(2, 1, height_ratios=heights)
    home = lambda token: token // tokens_per_rank  # the rank that held the token before
    draw_panels(before_part, before, home, color, heads_per_rank, "before")
    draw_panels(after_part, after, home, color, heads_per_rank, "after")
    caption(before_part, f"(a) before the exchange (02's seq_to_heads, pattern TO_HEADS): rank r "
                         f"holds its S/P = {tokens_per_rank} tokens of all H = {heads} heads, "
                         f"(B, S/P, H, D). The heads are cut into P = {ranks} groups of H/P = "
                         f"{heads_per_rank}; group j is sent to rank j.")
    caption(after_part, f"(b) after: rank j holds all S = {seq_len} tokens of its H/P = "
                        f"{heads_per_rank} heads, (B, S, H/P, D), ready for an ordinary "
                        "attention kernel over the whole sequence. Rows are colored by the rank "
                        "they came from: rank r's tokens arrive r-th, so the sequence is in order. "
                        "heads_to_seq (TO_TOKENS) is the inverse exchange: the attention output "
                        "goes back to (a)'s layout.")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def draw_panels(part, per_rank, home, color, heads_per_rank: int, when: str) -> None:
    """Per rank a grid: row i is the i-th token it holds, column c its c-th head; each cell shows
    the token's number, colored by the rank that held that token before the exchange."""
    from matplotlib.patches import Rectangle

    axes = part.subplots(1, len(per_rank), squeeze=False)[0]
    for rank, (ax, held) in enumerate(zip(axes, per_rank)):
        rows, columns = held.shape[0], held.shape[1]
        for row in range(rows):
            for column in range(columns):
                token = int(held[row, column, 0])
                ax.add_patch(Rectangle((column, row), 1, 1, facecolor=color(home(token)),
                                       edgecolor="white", lw=1.5))
                ax.text(column + 0.5, row + 0.5, f"t{token}", ha="center", va="center",
                        color="white", fontsize=8, weight="bold")
        if when == "before":  # the head groups, each to its rank
            for group in range(1, columns // heads_per_rank):
                ax.axvline(group * heads_per_rank, color="black", lw=2)
            for group in range(columns // heads_per_rank):
                ax.text((group + 0.5) * heads_per_rank, rows + 0.15, f"to rank {group}",
                        ha="center", va="top", fontsize=8, color="black")
        head_ids = held[0, :, 1].tolist()
        ax.set_xticks([c + 0.5 for c in range(columns)], [f"h{h}" for h in head_ids], fontsize=8)
        ax.xaxis.tick_top()
        ax.set_yticks([])
        ax.tick_params(length=0)
        ax.set_xlim(0, columns)
        ax.set_ylim(rows + (0.8 if when == "before" else 0), 0)
        ax.set_aspect("equal")
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"rank {rank}", fontsize=10, color=color(rank), weight="bold")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help=f"P, 1 to {MAX_RANKS}")
    parser.add_argument("--seq-len", type=int, default=8, help="S tokens (divisible by P)")
    parser.add_argument("--heads", type=int, default=8, help="H query heads (divisible by P)")
    parser.add_argument("--out", default="docs/ulysses_exchange.png", help="the PNG to write")
    opts = parser.parse_args(argv)
    before, after = layouts(opts.ranks, opts.seq_len, opts.heads)
    print_layouts(before, after)
    draw(before, after, opts.seq_len, opts.heads, Path(opts.out))


if __name__ == "__main__":
    main()
