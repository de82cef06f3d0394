"""The picture of 06's zigzag ring: which rank holds which part of the sequence, and which block
pairs each rank computes at each step of the ring.

    python -m bench.ring_diagram --ring 4 --out docs/ring_zigzag.png

No GPU and no processes: it asks 06_ring_attention.py itself, through `zigzag_chunks` (the two
chunks a rank holds) and `block_pairs` (what meets in one step, full or causal), so the picture
shows what the code does. It draws
  (a) the layout: the sequence cut into 2R chunks, each colored by the ring rank that holds it;
  (b) one panel per step: the 2R x 2R causal matrix (query chunk a down, key chunk b across),
      the block pairs computed at that step colored by the rank that computes them, a triangle
      where the pair is causal (b == a), the other steps' pairs in gray, keys after queries empty;
  (c) the work of each rank at each step, in chunk x chunk blocks (a causal block counts 1/2):
      the same for every rank at every step, so no rank waits for another at the K/V hand-over.
It also prints the schedule as text.
"""

import argparse
import textwrap
from pathlib import Path
from support.lessons import ring_sp


MAX_RING = 8  # past 8 ranks the 2R x 2R matrices are too small to read


def ring_schedule(ring: int) -> list[tuple[int, int, int, int, bool]]:
    """(step, rank, query chunk, key chunk, causal) for every block pair a ring of `ring` ranks
    computes, read from 06: at step s rank r holds the K/V of rank r - s (mod R), as
    ring_attention_forward passes them, and 06's block_pairs says which of its chunks meet."""
    ring_sp.check_ring(ring, ring)
    one_token_chunks = (1, 2)  # (batch, 2C) with C = 1: a local position is the chunk's slot
    schedule = []
    for step in range(ring):
        for rank in range(ring):
            owner = (rank - step) % ring
            for _, queries, keys, causal in ring_sp.block_pairs(one_token_chunks, rank,
                                                                       owner, ring):
                query_chunk = ring_sp.zigzag_chunks(rank, ring)[queries.start]
                key_chunk = ring_sp.zigzag_chunks(owner, ring)[keys.start]
                schedule.append((step, rank, query_chunk, key_chunk, causal))
    return schedule


def work_per_step(schedule, ring: int) -> list[list[float]]:
    """[step][rank] -> chunk x chunk blocks computed; a causal block is half the work of a full
    one."""
    work = [[0.0] * ring for _ in range(ring)]
    for step, rank, _, _, causal in schedule:
        work[step][rank] += 0.5 if causal else 1.0
    return work


def holder_of_chunk(chunk: int, ring: int) -> int:
    return next(rank for rank in range(ring) if chunk in ring_sp.zigzag_chunks(rank, ring))


def print_schedule(schedule, ring: int) -> None:
    print(f"zigzag ring of R = {ring}: {2 * ring} chunks; "
          + ", ".join(f"rank {r} holds {ring_sp.zigzag_chunks(r, ring)}"
                      for r in range(ring)))
    work = work_per_step(schedule, ring)
    for step in range(ring):
        print(f"step {step}:")
        for rank in range(ring):
            pairs = [f"q{a}-k{b}" + (" causal" if causal else "")
                     for s, r, a, b, causal in schedule if (s, r) == (step, rank)]
            print(f"  rank {rank} (K/V of rank {(rank - step) % ring}): {', '.join(pairs)}"
                  f"  = {work[step][rank]:g} blocks")


def draw(schedule, ring: int, path: Path) -> None:
    """The three parts, one above the other, into one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width_inches = max(3.1 * ring + 1.2, 10)  # the captions need ~10 inches
    wrap = lambda text: textwrap.fill(text, int(width_inches * 13.5), subsequent_indent="     ")
    caption = lambda part, text: part.suptitle(wrap(text), x=0.01, ha="left", fontsize=10)
    color = lambda rank: plt.get_cmap("tab10")(rank % 10)
    fig = plt.figure(figsize=(width_inches, 9.2), layout="constrained")
    layout_part, steps_part, work_part = fig.subfigures(3, 1, height_ratios=[1.0, 3.6, 1.8])
    draw_layout(layout_part, ring, color, caption)
    draw_steps(steps_part, schedule, ring, color, caption)
    draw_work(work_part, schedule, ring, color, caption)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def draw_layout(part, ring: int, color, caption) -> None:
    """(a) the sequence's 2R chunks in token order, each colored by the rank that holds it."""
    from matplotlib.patches import Rectangle

    chunks = 2 * ring
    ax = part.subplots()
    for chunk in range(chunks):
        rank = holder_of_chunk(chunk, ring)
        ax.add_patch(Rectangle((chunk, 0), 1, 1, facecolor=color(rank), edgecolor="white", lw=2))
        ax.text(chunk + 0.5, 0.5, f"chunk {chunk}\nrank {rank}", ha="center", va="center",
                color="white", fontsize=9 if ring <= 4 else 7, weight="bold")
    ax.annotate("", xy=(chunks, -0.25), xytext=(0, -0.25), annotation_clip=False,
                arrowprops=dict(arrowstyle="->", color="gray"))
    ax.text(chunks / 2, -0.45, "token position: the sequence of S tokens, cut into 2R chunks of "
            f"S/{chunks}", ha="center", va="top", fontsize=9, color="gray")
    ax.set_xlim(0, chunks)
    ax.set_ylim(-0.9, 1)
    ax.axis("off")
    holds = "; ".join(f"rank {r}: {a} and {b}" for r in range(ring)
                      for a, b in [ring_sp.zigzag_chunks(r, ring)])
    caption(part, f"(a) zigzag layout, R = {ring} ranks: rank i holds chunks i and 2R-1-i, one "
                  f"early, one late ({holds})")


def draw_steps(part, schedule, ring: int, color, caption) -> None:
    """(b) per step, the 2R x 2R causal matrix: that step's block pairs in the computing rank's
    color (a triangle where causal), the other steps' in gray, keys after queries left empty."""
    from matplotlib.patches import Polygon, Rectangle

    chunks = 2 * ring
    step_of = {(a, b): (step, rank) for step, rank, a, b, _ in schedule}
    causal_pairs = {(a, b) for _, _, a, b, causal in schedule if causal}
    cell_text = ring <= 4  # past 4 ranks the cells are too small for text
    for step, ax in enumerate(part.subplots(1, ring, squeeze=False)[0]):
        for (a, b), (pair_step, rank) in step_of.items():
            now, causal = pair_step == step, (a, b) in causal_pairs
            fill = color(rank) if now else "#e6e6e6"
            if causal:  # keys up to each query: the lower-left triangle
                ax.add_patch(Polygon([(b, a), (b, a + 1), (b + 1, a + 1)], facecolor=fill,
                                     edgecolor="none"))
            else:
                ax.add_patch(Rectangle((b, a), 1, 1, facecolor=fill, edgecolor="none"))
            if cell_text:
                ax.text(b + (0.33 if causal else 0.5), a + (0.7 if causal else 0.5),
                        f"r{rank}" if now else f"s{pair_step}", ha="center", va="center",
                        fontsize=8 if now else 7, color="white" if now else "#999999",
                        weight="bold" if now else "normal")
        for line in range(chunks + 1):
            ax.axhline(line, color="white", lw=1.5 if cell_text else 0.8)
            ax.axvline(line, color="white", lw=1.5 if cell_text else 0.8)
        ax.plot([0, chunks], [0, chunks], color="#bbbbbb", lw=0.8)  # the causal diagonal
        ax.set_xlim(0, chunks)
        ax.set_ylim(chunks, 0)
        ax.set_aspect("equal")
        ticks, names = [c + 0.5 for c in range(chunks)], [str(c) for c in range(chunks)]
        tick_size = 9 if cell_text else 6
        ax.set_xticks(ticks, names, fontsize=tick_size, weight="bold")
        ax.set_yticks(ticks, names, fontsize=tick_size, weight="bold")
        for chunk, label in enumerate(ax.get_xticklabels()):  # K/V moved `step` ranks on
            label.set_color(color((holder_of_chunk(chunk, ring) + step) % ring))
        for chunk, label in enumerate(ax.get_yticklabels()):  # queries stay home
            label.set_color(color(holder_of_chunk(chunk, ring)))
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_xlabel("key chunk b", fontsize=9)
        if step == 0:
            ax.set_ylabel("query chunk a", fontsize=9)
        held = "its own K/V" if step == 0 else f"the K/V of rank r-{step}"
        ax.set_title(f"step {step}: rank r holds\n{held}", fontsize=10)
    kv_path = " -> ".join(str(rank) for rank in [*range(ring), 0])
    caption(part, "(b) the ring's steps: after each step every rank passes the K/V it holds to the "
                  f"next ({kv_path}); after R steps every query chunk has met every key chunk. "
                  "Colored: the pairs computed at that step, by the rank that computes them"
                  + (" (r = rank)" if cell_text else "") + "; triangle: causal (b = a); gray: "
                  "another step's" + (" (s = that step)" if cell_text else "") + "; empty: keys "
                  "after queries, skipped. Chunk numbers are colored by the rank that holds them "
                  "at that step: the queries stay, the keys travel.")


def draw_work(part, schedule, ring: int, color, caption) -> None:
    """(c) blocks computed per rank per step, side by side."""
    work = work_per_step(schedule, ring)
    ax = part.subplots()
    width = 0.8 / ring
    for rank in range(ring):
        ax.bar([step + (rank - (ring - 1) / 2) * width for step in range(ring)],
               [work[step][rank] for step in range(ring)], width * 0.9, color=color(rank),
               label=f"rank {rank}")
    ax.set_xticks(range(ring), [f"step {step}" for step in range(ring)])
    ax.set_ylabel("blocks computed")
    ax.set_ylim(0, max(max(row) for row in work) * 1.3)
    ax.legend(ncol=ring, fontsize=8, loc="upper right", frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    caption(part, "(c) work per rank per step (chunk x chunk blocks; a causal block counts 1/2): "
                  "equal everywhere, so every rank finishes a step together and passes its K/V on")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ring", type=int, default=4, help=f"ring degree R (1 to {MAX_RING})")
    parser.add_argument("--out", default="docs/ring_zigzag.png", help="the PNG to write")
    opts = parser.parse_args(argv)
    if not 1 <= opts.ring <= MAX_RING:
        raise ValueError(f"--ring must be between 1 and {MAX_RING} (got {opts.ring}): past "
                         f"{MAX_RING} ranks the picture's {2 * MAX_RING} x {2 * MAX_RING} "
                         "matrices are too small to read")
    schedule = ring_schedule(opts.ring)
    print_schedule(schedule, opts.ring)
    draw(schedule, opts.ring, Path(opts.out))


if __name__ == "__main__":
    main()
