"""progress.py - what a training run shows of itself: its first lines, a line per step, a bar
within each step, a closing summary.

The first lines say what runs: 06's and 05's layout, then the model, the tokens, the ranks, the
learning rate, the attention kernel and the techniques (the log file's first record holds the
same, with the whole Config). Each step prints one line and logs one record (support/saved_state
writes the log). A step at a million tokens takes minutes, so on a terminal a bar counts the
step's layer passes (each block's forward, then its backward). It never reaches a file: written
into a redirected log, a bar's carriage returns would garble the step lines. The summary line
closes every run: steps, wall time, first -> last loss, mean throughput, peak GPU memory, the
last saved state.
"""

import contextlib
import statistics
import sys
from dataclasses import asdict

import torch
from tqdm import tqdm

from model import num_params
from base import kernels
from support import config
from support.config import model_name, techniques_text

# The run's first lines and its log's first record.

def layout_lines(cfg, rt, n_heads: int) -> list:
    """06's and 05's layout, said before the model is built (rank 0 prints them)."""
    lines = []
    if rt.ring > 1:
        lines.append(f"Ulysses x ring: {rt.ulysses} x {rt.ring} (06)" + (
            "; --ring picked: the heads do not split over all P ranks" if cfg.ring is None else ""))
    if cfg.untied:
        stages = n_heads // (cfg.head_chunk or rt.ulysses)
        lines.append(f"Untied Ulysses: {stages} stage{'s' if stages > 1 else ''} of "
                     f"U = {cfg.head_chunk or rt.ulysses} query heads")
    return lines


def run_header(cfg, rt, args, first_step: int, expected: dict | None = None) -> dict:
    """The log's first record: the Config, the ranks, torch, the kernel, the size, the start,
    and where the run was planned its predicted step and peak."""
    return {"config": asdict(cfg), "world_size": rt.world, "dp": rt.dp, "sp": rt.sp,
            "ring": rt.ring, "torch": torch.__version__,
            "attention_kernel": attention_kernel(cfg, rt, args),
            "parameters": num_params(args), "first_step": first_step,
            **({"planned": expected} if expected else {})}


def opening_text(cfg, rt, header: dict, data) -> str:
    """The run's first line (and a note where --documents was left out of a documents file)."""
    documents = ("separator " + str(data.separator) if data.separator is not None
                 else "boundary index")
    text = (f"{model_name(cfg)}: {header['parameters'] / 1e6:.1f}M params, {cfg.seq_len:,} tokens"
            + (f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
            + f", world {rt.world} (dp {rt.dp} x sp {rt.sp}), {cfg.dtype} on {cfg.device}, "
            f"{schedule_text(cfg)}, attention: {header['attention_kernel']}, techniques: "
            f"{techniques_text(cfg, cfg.head_chunk or rt.ulysses, rt.ring)}"
            + (f", packed documents ({documents})" if cfg.documents else "")
            + (f", resumed at step {header['first_step']}" if cfg.resume else ""))
    if data.documents_ignored:
        text += (f"\nnote: {cfg.data} lists its documents (sidecar or .docs index), but without "
                 f"--documents each window trains as one sequence: documents attend to each other")
    return text


def schedule_text(cfg) -> str:
    """The learning rate as the run's first line says it: peak, warmup, schedule."""
    default = cfg.lr == config.default_lr(cfg)
    size = "--init-from" if cfg.init_from else "this size"
    return (f"lr {cfg.lr:g}" + (f" (--lr's default for {size})" if default else "")
            + (f" after {cfg.warmup_steps} warmup steps" if cfg.warmup_steps else "")
            + (f", {cfg.lr_schedule} to {cfg.min_lr:g} at step {cfg.steps}"
               if cfg.lr_schedule != "constant" else ""))


def attention_kernel(cfg, rt, args) -> str:
    """The kernel attention runs (for the log); 05, 06's ring and --keep-attention call its
    forward and backward separately."""
    name = kernels.attention_kernel_name(rt.device, getattr(torch, cfg.dtype), args.head_dim)
    users = [number for number, on in (("05", cfg.untied), ("06", rt.ring > 1),
                                       ("03", cfg.keep_attention)) if on]
    if users:
        name += f" (forward and backward with log-sum-exp, {', '.join(users)})"
    return name


# A line per step.

def step_record(step: int, metrics: dict, step_time: float, tokens_per_gpu: float, documents,
                rt) -> dict:
    """A step's line of the log: its metrics (loss, grad_norm, lr), time, throughput, memory."""
    return {"step": step, **metrics, "step_time_s": round(step_time, 4),
            **({"documents": documents.count} if documents is not None else {}),
            "tokens_per_s_per_gpu": round(tokens_per_gpu / step_time, 1),
            "peak_gpu_mem_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 3)
                                 if rt.device.type == "cuda" else None),
            **({"alloc_retries_so_far": allocator_retries()} if rt.device.type == "cuda" else {})}


def allocator_retries() -> int:
    """The caching allocator's retries so far in this process (num_alloc_retries: a cudaMalloc
    that failed, the cached blocks given back, tried again; each synchronizes the GPU): a step
    near the GPU's capacity pays for these (support/step_time.py's allocator term)."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0)


def step_text(record: dict, per: str) -> str:
    mem = f" | peak {record['peak_gpu_mem_gib']:.2f} GiB" if record["peak_gpu_mem_gib"] else ""
    return (f"step {record['step']:4d} | loss {record['loss']:.4f} | lr {record['lr']:.3g} | "
            f"{record['tokens_per_s_per_gpu']:,.0f} tok/s/{per} | "
            f"{record['step_time_s']:.3f}s{mem}")


# A bar within each step, and the closing summary.

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
                 last_saved: str | None, resume: str | None, expected: dict | None = None) -> str:
    """The run's closing line. history: this run's step records (train.py's log lines);
    tokens_per_step: the tokens of one step per GPU (per rank on the CPU); expected: what the
    plan predicted (plan.RunChoice.expected), which a second line holds the run to."""
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
        text += f"; saved state {last_saved}; continue (with a larger --steps): {resume}"
    else:
        text += "; no saved state (no --save-dir)"
    return text + (against_the_plan(history, expected) if expected and peaks else "")


def against_the_plan(history: list, expected: dict) -> str:
    """The run held to its plan: the median step after the first (the first compiles and
    allocates) against the predicted, the peak against the planned, and the allocator's
    retries after the first step where they are more than the plan priced (each gives the cache
    back and waits on the GPU), with what leaves more memory free."""
    later = history[1:] or history
    peak = max(h["peak_gpu_mem_gib"] for h in history)
    median = statistics.median(h["step_time_s"] for h in later)
    text = f"\nagainst the plan: median step {median:.3f}s"
    if len(history) == 1:
        text += " (the first step: it also compiles and allocates)"
    if expected["step_s"] is not None:
        text += f" (predicted {expected['step_s']:.3f}s)"
    text += f", peak {peak:.2f} GiB (planned {expected['peak_gib']:.2f})"
    retries = later[-1].get("alloc_retries_so_far", 0) - history[0].get("alloc_retries_so_far", 0)
    priced = expected.get("retries_per_step", 0) * (len(history) - 1)
    if retries > priced:
        text += (f"; the allocator gave its cache back and retried {retries} times after the "
                 f"first step ({priced} priced by the plan), each a wait on the GPU: a plan that "
                 f"leaves more memory free at its peak avoids that"
                 + (f" ({expected['more_free']}, for one)" if expected.get("more_free") else ""))
    return text
