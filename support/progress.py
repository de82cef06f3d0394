"""progress.py - what a training run shows of itself: a bar within each step, a closing summary.

A step at a million tokens takes minutes, so on a terminal a bar counts the step's layer passes
(each block's forward, then its backward). It never reaches a file: written into a redirected
log, a bar's carriage returns would garble the step lines. The summary line closes every run:
steps, wall time, first -> last loss, mean throughput, peak GPU memory, the last saved state.
"""

import contextlib
import sys

from tqdm import tqdm


@contextlib.contextmanager
def layer_bars(model, micro_batches: int, enabled: bool, file=None):
    """Yields `start(step)`, which opens the bar of that step's 2 x layers x micro_batches layer
    passes (closing the previous one); without `enabled` (not rank 0, not a terminal) it does
    nothing. Hooks on the blocks count: a block's forward as it starts; its backward when the
    gradient of its output arrives. (03's recompute calls the block's inner forward, not the
    module, so a recompute is not counted twice.)"""
    bar, hooks = {}, []

    def start(step: int):
        if "now" in bar:
            bar.pop("now").close()
        if enabled:
            bar["now"] = tqdm(total=2 * len(model.layers) * micro_batches, desc=f"step {step}",
                              unit="layer", leave=False, position=1, file=file or sys.stderr)

    def count(*_):
        if "now" in bar:
            bar["now"].update(1)

    def count_backward_too(_module, _inputs, output):
        if "now" in bar and output.requires_grad:
            output.register_hook(count)

    if enabled:
        for block in model.layers:
            hooks.append(block.register_forward_pre_hook(count))
            hooks.append(block.register_forward_hook(count_backward_too))
    try:
        yield start
    finally:
        if "now" in bar:
            bar.pop("now").close()
        for hook in hooks:
            hook.remove()


def on_a_terminal(is_main: bool) -> bool:
    """Bars only from rank 0 and only onto a terminal (never into a log file)."""
    return is_main and sys.stderr.isatty()


def summary_line(history: list, tokens_per_step: float, wall_s: float, per: str,
                 last_saved: str | None, resume: str | None) -> str:
    """The run's closing line. history: this run's step records (train.py's log lines);
    tokens_per_step: the tokens of one step per GPU (per rank on the CPU)."""
    if not history:
        return "done: no step to train" + (f"; saved state {last_saved}" if last_saved else "")
    n = len(history)
    step_time = sum(h["step_time_s"] for h in history)
    peaks = [h["peak_gpu_mem_gib"] for h in history if h["peak_gpu_mem_gib"] is not None]
    text = (f"done: {n} step{'s' if n > 1 else ''} ({history[0]['step']}-{history[-1]['step']}) "
            f"in {wall_s:.1f}s, loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}, "
            f"{n * tokens_per_step / step_time:,.0f} tok/s/{per} (mean)"
            + (f", peak GPU memory {max(peaks):.2f} GiB" if peaks else ""))
    if last_saved:
        return text + f"; saved state {last_saved}; continue (with a larger --steps): {resume}"
    return text + "; no saved state (no --save-dir)"
