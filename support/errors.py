"""errors.py - how a run fails: an out-of-memory error naming the phase of the step it happened
in and what to turn on next, and a process that ends with `error: ...` and exit code 1 instead
of a traceback.

Under torchrun every rank runs the same code, so an error that every rank meets alike (bad flags,
a missing file, what the ranks decide together) would be printed once per rank: the first rank
of each node prints it (a node's torchrun prints one log), the others stay quiet.
"""

import contextlib
import io
import os
import sys
import time

import torch
import torch.distributed as dist

from support import pretrained, saved_state
from support.config import model_args


class StepOutOfMemory(torch.OutOfMemoryError):
    """torch's out-of-memory error with the phase of the step it happened in (so code that
    catches torch.OutOfMemoryError catches this one too)."""


@contextlib.contextmanager
def out_of_memory_names(phase: str):
    try:
        yield
    except StepOutOfMemory:  # already named by an inner phase
        raise
    except torch.OutOfMemoryError as error:
        first_line = str(error).splitlines()[0]
        raise StepOutOfMemory(f"out of GPU memory in the {phase}: {first_line}") from error


@contextlib.contextmanager
def what_to_try_next(cfg, rt):
    """A step's out-of-memory error (StepOutOfMemory), raised again with what to turn on next."""
    try:
        yield
    except StepOutOfMemory as error:
        raise StepOutOfMemory(out_of_memory_report(error, cfg, rt)) from error


def out_of_memory_report(error: Exception, cfg, rt) -> str:
    """A step's out-of-memory error with the allocator's account and what to turn on next."""
    summary = ""
    if torch.cuda.is_available():
        summary = (f"\npeak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB of "
                   f"{torch.cuda.get_device_properties(rt.device).total_memory / 2**30:.1f} GiB; "
                   f"allocator summary:\n{torch.cuda.memory_summary(rt.device, abbreviated=True)}")
    return f"{error}{summary}\nnext: try {next_memory_technique(cfg, rt.ulysses)}"


def next_memory_technique(cfg, sp: int) -> str:
    """What to turn on next when a step does not fit, in the order of the files."""
    if not cfg.fsdp:
        return "--fsdp (01: shard the model state)"
    if not (cfg.ulysses or cfg.untied):
        return "--ulysses (02: split the sequence over the GPUs)"
    if not cfg.checkpoint:
        return "--checkpoint (03: keep only each block's input for backward)"
    n_layers = model_args(cfg).n_layers
    if (cfg.checkpoint_layers or n_layers) < n_layers:
        return (f"a larger --checkpoint-layers (03: up to all {n_layers} blocks; python plan.py "
                f"with the same flags names the fewest that fit)")
    if not cfg.offload:
        return "--offload (03: move those inputs to CPU memory)"
    if not (cfg.tile_mlp and cfg.tile_loss):  # not --tile-norm: the fused CUDA norm needs none
        return "--tile-mlp --tile-loss (04: no sequence-wide MLP or logits buffers)"
    if not cfg.untied:
        return "--untied (05: one head chunk of Q/K/V resident at a time)"
    if cfg.head_chunk and cfg.head_chunk > sp:
        return f"a smaller --head-chunk (down to {sp})"
    if not cfg.offload_model_state:
        return "--offload-model-state (01: parameters, gradients and Adam in host memory)"
    return "fewer tokens per GPU: a shorter --seq-len or more GPUs"


def exit_on_error(run) -> None:
    """run(); a failure we explain (bad input, a non-finite step, out of memory, a stop) ends
    the process with `error: ...` and exit code 1, no traceback. The process group goes either
    way.

    Under torchrun, an error that every rank meets alike is printed once, by the first rank of
    each node; the others wait a moment before they exit, as torchrun stops the remaining
    workers as soon as one ends. A rank's own error (out of memory) is printed by that rank, with
    its rank."""
    try:
        run()
    except (ValueError, FloatingPointError, StepOutOfMemory, saved_state.StopRequested,
            saved_state.SaveFailed, pretrained.ExportFailed) as error:
        if isinstance(error, StepOutOfMemory) and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            print(f"[rank {os.environ.get('RANK', '?')}] error: {error}", file=sys.stderr,
                  flush=True)
        elif first_rank_of_node():
            print(f"error: {error}", file=sys.stderr, flush=True)
        else:
            time.sleep(1)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def first_rank_of_node() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


@contextlib.contextmanager
def quiet_unless_first_rank():
    """Swallow what is printed inside, except on the first rank of a node."""
    if first_rank_of_node():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            yield
        except SystemExit as stop:  # argparse's error: let the first rank print it first
            if stop.code:
                time.sleep(1)
            raise
