"""saved_state.py - save a training run and continue it: model, optimizer, RNG and step.

"Saved state" here, not "checkpoint": 03's activation checkpoints are block inputs kept for
backward within one step; this file writes the training state to disk so a run survives a
crash, a time limit or a scheduler's signal (the messages a user reads keep the common word
"checkpoint"). Each rank writes only its own shards (torch.distributed.checkpoint, "dcp"), into
a temporary folder that becomes step_N by an atomic rename once every rank has finished;
resuming restores the newest complete one. The data position is the step, so nothing else is
needed to continue exactly (tests/test_saved_state.py: the resumed loss log equals an
uninterrupted one, bit for bit).
"""

import contextlib
import json
import os
import shlex
import shutil
import signal
import sys
import threading
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from tqdm import tqdm

from support import paths, pretrained


# ---------------------------------------------------------------------------------------------
# Saved training state: sharded (torch.distributed.checkpoint), atomic, resumable.
# ---------------------------------------------------------------------------------------------

def saved_meta(cfg, rt, args, step: int) -> dict:
    return {"step": step, "model": cfg.model, "model_args": asdict(args),
            "world_size": rt.world, "sp": rt.sp, "seed": cfg.seed, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "data": cfg.data,
            "lr": cfg.lr, "weight_decay": cfg.weight_decay, "warmup_steps": cfg.warmup_steps,
            "lr_schedule": cfg.lr_schedule, "min_lr": cfg.min_lr, "steps": cfg.steps}


# What a meta.json written before these were saved means by their absence.
OLDER_SAVES = {"warmup_steps": 0, "lr_schedule": "constant", "grad_accum": 1}


def saved_value(meta: dict, key: str):
    return meta.get(key, OLDER_SAVES.get(key))


class SaveFailed(RuntimeError):
    """A state could not be saved; the message says why and which saved one is still intact."""


def save_state(cfg, rt, model, optimizer, step: int) -> str:
    """Write model + optimizer shards, RNG states and the step into save_dir/step_N.

    Everything goes into step_N.tmp first; only when every rank has written its part does rank 0
    rename it to step_N (a rename is atomic), so a crash mid-write leaves the previous save as
    the latest complete one. The two newest saves are kept. A state that is not finite is never
    written (it would replace a good save with one that fails on resume), and a write that
    fails (a full disk) removes its .tmp and says which save is still intact.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(cfg.save_dir, f"step_{step:08d}")
    tmp = final + ".tmp"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if any_rank(not state_is_finite(state), rt):
        raise FloatingPointError(f"the model or optimizer state is not finite after step {step}: "
                                 f"not saved; {intact_text(cfg.save_dir)}")
    need = state_bytes(state, rt)
    free = shutil.disk_usage(cfg.save_dir).free
    if free < need:
        raise SaveFailed(f"no space left in {cfg.save_dir} for step {step}: it needs about "
                         f"{need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB are free; "
                         f"{intact_text(cfg.save_dir)}")
    error = None
    if rt.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(rt)
    try:
        with quiet_single_process_dcp():
            dcp.save(state, checkpoint_id=tmp)
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(rt.device) if rt.device.type == "cuda" else None}
        torch.save(rng, os.path.join(tmp, f"rng_rank{rt.rank}.pt"))
        if rt.rank == 0:
            with open(os.path.join(tmp, "meta.json"), "w") as f:
                json.dump(saved_meta(cfg, rt, model.args, step), f, indent=1)
    except (OSError, RuntimeError) as caught:  # a full disk: "enforce fail at inline_container.cc"
        error = caught
    if any_rank(error is not None, rt):
        if rt.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        first_line = str(error).strip().splitlines()[0] if error else "failed on another rank"
        raise SaveFailed(f"saving step {step} into {cfg.save_dir} failed ({first_line}); "
                         f"{intact_text(cfg.save_dir)}") from error
    if rt.rank == 0:
        if os.path.exists(final):  # the same step saved again (e.g. after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in complete_saves(cfg.save_dir)[:-2]:
            shutil.rmtree(old)
    barrier(rt)
    return final


def state_is_finite(state) -> bool:
    """Every floating tensor of this rank's part of `state` (nested dicts/lists) is finite."""
    if isinstance(state, dict):
        return all(state_is_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(state_is_finite(v) for v in state)
    if isinstance(state, torch.Tensor) and state.is_floating_point():
        local = state.to_local() if hasattr(state, "to_local") else state
        return bool(torch.isfinite(local).all())
    return True


def state_bytes(state, rt) -> int:
    """Bytes the save of `state` takes on disk, over all ranks (the shards' sizes)."""
    def local(s):
        if isinstance(s, dict):
            return sum(local(v) for v in s.values())
        if isinstance(s, (list, tuple)):
            return sum(local(v) for v in s)
        if isinstance(s, torch.Tensor):
            t = s.to_local() if hasattr(s, "to_local") else s
            return t.numel() * t.element_size()
        return 0

    total = torch.tensor([float(local(state))], device=rt.device)
    if rt.world > 1:
        dist.all_reduce(total)
    return int(total.item())


def intact_text(save_dir: str) -> str:
    found = complete_saves(save_dir)
    return f"the previous checkpoint {found[-1]} is intact" if found else "no earlier checkpoint"


def complete_saves(save_dir: str) -> list[str]:
    """Complete saves (step_N folders renamed from .tmp, with meta.json), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = sorted(n for n in os.listdir(save_dir)
                   if n.startswith("step_") and not n.endswith(".tmp"))
    paths = [os.path.join(save_dir, n) for n in names]
    return [p for p in paths if os.path.isfile(os.path.join(p, "meta.json"))]


def load_state(cfg, rt, model, optimizer) -> int:
    """Restore the newest readable complete save of save_dir; returns the step to continue
    from. A save that cannot be read (truncated shard, bad meta.json) is named and the one
    before it is tried; one written for another model, world, sequence length or batch is refused
    (those are the command's mistakes, not damage). The command line's lr, weight decay, warmup
    and schedule win over the saved ones, and a change is said."""
    found = complete_saves(cfg.save_dir)
    if not found:
        raise ValueError(f"--resume: no complete checkpoint in {cfg.save_dir!r}")
    for path in reversed(found):
        meta = read_meta(path)
        if meta is not None:
            check_resumable(cfg, rt, model, path, meta)
        error = None if meta is not None else f"{os.path.join(path, 'meta.json')} is not valid"
        if error is None:
            try:
                restore_state(rt, path, model, optimizer)
            except (Exception, CheckpointException) as caught:  # damage: try the one before
                error = last_line(caught)
        if not any_rank(error is not None, rt):
            break
        if rt.rank == 0:
            print(f"warning: cannot read checkpoint {path} ({error or 'failed on another rank'}); "
                  f"trying the one before it", file=sys.stderr)
    else:
        raise ValueError(f"--resume: none of the checkpoints in {cfg.save_dir!r} can be read "
                         f"({', '.join(os.path.basename(p) for p in found)})")
    for group in optimizer.param_groups:  # loading restored the saved values; the flags win
        group["lr"], group["weight_decay"] = cfg.lr, cfg.weight_decay
    keys = ["lr", "weight_decay", "warmup_steps"]
    if (cfg.lr_schedule, saved_value(meta, "lr_schedule")) != ("constant", "constant"):
        keys += ["lr_schedule", "min_lr", "steps"]  # a decay: to where, and at which step
    given = {k: getattr(cfg, k) for k in keys}
    saved = {k: saved_value(meta, k) for k in keys}
    if rt.rank == 0 and saved != given:
        flags = " ".join(f"--{k.replace('_', '-')} {given[k]}" for k in keys)
        values = ", ".join(f"{k.replace('_', ' ')} {saved[k]}" for k in keys)
        print(f"resume: using {flags} from the command line "
              f"(the checkpoint was saved with {values})")
    if cfg.steps == meta["step"] and rt.rank == 0:
        print(f"resume: {path} is already at step {meta['step']} = --steps; nothing to train")
    return meta["step"]


def last_line(error: BaseException) -> str:
    """The informative line of an error: dcp's CheckpointException carries each rank's whole
    traceback, whose last line is the cause (e.g. EOFError of a truncated shard)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__


def read_meta(path: str) -> dict | None:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) else None
    except (OSError, ValueError):
        return None


def check_model_shape(path: str, meta: dict, args, flag: str) -> None:
    model_args = asdict(args)
    if meta.get("model_args") != model_args:
        saved = meta.get("model_args") or {}
        changed = {k: (saved.get(k), v) for k, v in model_args.items() if saved.get(k) != v}
        raise ValueError(f"{flag}: {path} holds a model of another shape "
                         f"({meta.get('model')}; differs in {changed} as (checkpoint, now))")


def checked_meta(path: str, args, flag: str) -> dict:
    """The save's meta.json, or a ValueError naming it if it is unreadable or holds a
    model of another shape."""
    meta = read_meta(path)
    if meta is None:
        raise ValueError(f"{flag}: {os.path.join(path, 'meta.json')} is missing or not valid JSON")
    check_model_shape(path, meta, args, flag)
    return meta


def check_resumable(cfg, rt, model, path: str, meta: dict) -> None:
    check_model_shape(path, meta, model.args, "--resume")
    if meta.get("world_size") != rt.world or meta.get("sp") != rt.sp:
        saved_ranks = meta.get("world_size")
        plural = "s" if saved_ranks != 1 else ""
        raise ValueError(f"--resume: {path} was saved by {saved_ranks} rank{plural} "
                         f"with sp {meta.get('sp')}; this run has {rt.world} "
                         f"rank{'s' if rt.world > 1 else ''} with sp {rt.sp}")
    # The data position is the step: another length or batch would continue on other tokens.
    for key, flag in (("seq_len", "--seq-len"), ("batch_size", "--batch-size"),
                      ("grad_accum", "--grad-accum")):
        saved = saved_value(meta, key)
        if saved is not None and saved != getattr(cfg, key):
            raise ValueError(f"--resume: {path} was trained with {flag} {saved}, this run asks "
                             f"for {getattr(cfg, key)}; resume with {flag} {saved}, or start a "
                             f"new run in another --save-dir")
    if cfg.steps < meta["step"]:
        raise ValueError(f"--resume: {path} is at step {meta['step']}, past --steps {cfg.steps}; "
                         f"pass --steps larger than {meta['step']} to train further")


def restore_state(rt, path: str, model, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=path)
    rng = torch.load(os.path.join(path, f"rng_rank{rt.rank}.pt"), weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], rt.device)


def load_model_state(path: str, model, flag: str = "--save-dir") -> dict:
    """Only the model weights of a saved training state, for evaluation: `path` is a save dir
    (its newest complete save) or one step_N folder. No optimizer, RNG or step; any
    number of ranks and any sharding (torch.distributed.checkpoint reshards on load, unlike
    --resume, which needs the saving layout for the RNG states). Returns the meta, with "path"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not os.path.isfile(os.path.join(path, "meta.json")):
        found = complete_saves(path)
        if not found:
            raise ValueError(f"{flag}: no complete checkpoint in {path!r}")
        path = found[-1]
    meta = checked_meta(path, model.args, flag)
    state = {"model": get_model_state_dict(model)}
    with quiet_single_process_dcp():
        dcp.load(state, checkpoint_id=path)  # the optimizer's entries stay on disk
    set_model_state_dict(model, state["model"])
    return {**meta, "path": path}


@contextlib.contextmanager
def quiet_single_process_dcp():
    """torch.distributed.checkpoint warns when used without a process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------------------------
# Outputs: checked before anything is written, never an input, never an earlier run's.
# ---------------------------------------------------------------------------------------------

LOCK_NAME = ".lock"


def check_outputs(cfg) -> None:
    """Refuse, before anything is written, an output path that would destroy something: the
    --data file (opening it for the log truncates it), an earlier run's saved states or log
    (unless --resume continues them or --overwrite says so), or a place that cannot be written
    (which would otherwise fail only when the first save comes, after the training). One rule
    for every output: missing folders on its path are fine; they are created when the run
    claims its outputs (claim_outputs), once every check has passed."""
    inputs = {"--data": cfg.data if cfg.data != "synthetic" else None, "--init-from": cfg.init_from}
    for flag, path in (("--log-file", cfg.log), ("--save-dir", cfg.save_dir),
                       ("--export-hf", cfg.export_hf)):
        for input_flag, input_path in inputs.items():
            if path and input_path and same_path(path, input_path):
                raise ValueError(f"{flag} {path!r} is the {input_flag} input: an output may not "
                                 f"be an input")
    if cfg.log and cfg.save_dir and same_path(cfg.log, cfg.save_dir):
        raise ValueError(f"--log-file and --save-dir are both {cfg.log!r}; name a file for the log")
    if cfg.export_hf:  # the export replaces its folder whole, at the end of the run
        for flag, path in (("--log-file", cfg.log), ("--save-dir", cfg.save_dir), *inputs.items()):
            if path and is_inside(path, cfg.export_hf):
                raise ValueError(f"{flag} {path!r} is inside the --export-hf folder "
                                 f"{cfg.export_hf!r}, which the export replaces: choose "
                                 f"another folder for one of them")
    if cfg.save_dir:
        for folder in [cfg.save_dir, *parents_of(cfg.save_dir)]:  # a save: step_N/meta.json
            if (os.path.basename(folder).startswith("step_")
                    and os.path.isfile(os.path.join(folder, "meta.json"))):
                raise ValueError(f"--save-dir {cfg.save_dir!r} is inside the saved state "
                                 f"{folder!r}: name the folder that holds the step_* folders")
        if cfg.resume and not complete_saves(cfg.save_dir):
            raise ValueError(f"--resume: no complete checkpoint in {cfg.save_dir!r} (a folder "
                             f"of step_* folders, each with a meta.json)")
    if cfg.log:
        if os.path.isdir(cfg.log):
            raise ValueError(f"--log-file {cfg.log!r} is a directory; name a file")
        if os.path.exists(cfg.log):
            if not os.access(cfg.log, os.W_OK):
                raise ValueError(f"--log-file {cfg.log!r} is not writable")
        else:
            paths.check_can_write("--log-file", cfg.log)
        if os.path.getsize(cfg.log) if os.path.isfile(cfg.log) else 0:
            if not (cfg.resume or cfg.overwrite):
                raise ValueError(f"--log-file {cfg.log!r} is not empty (an earlier run's log?): "
                                 f"add --resume to continue that run (the log is appended to), "
                                 f"choose another file, or add --overwrite to replace it")
    if cfg.save_dir:
        if os.path.exists(cfg.save_dir) and not os.path.isdir(cfg.save_dir):
            raise ValueError(f"--save-dir {cfg.save_dir!r} is a file, not a directory")
        paths.check_can_write("--save-dir", cfg.save_dir, cfg.save_dir)
        found = complete_saves(cfg.save_dir)
        if found and not (cfg.resume or cfg.overwrite):
            raise ValueError(f"--save-dir {cfg.save_dir!r} already holds checkpoints (newest: "
                             f"{os.path.basename(found[-1])}): add --resume to continue from it, "
                             f"choose another folder, or add --overwrite to delete them")


def same_path(a: str, b: str) -> bool:
    if os.path.exists(a) and os.path.exists(b):
        return os.path.samefile(a, b)
    return os.path.realpath(a) == os.path.realpath(b)


def is_inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies anywhere below it (links resolved)."""
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def parents_of(path: str) -> list[str]:
    """The folders above `path`, nearest first."""
    path, found = os.path.abspath(path), []
    while os.path.dirname(path) != path:
        path = os.path.dirname(path)
        found.append(path)
    return found


def parent_of(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


@contextlib.contextmanager
def claim_outputs(cfg, rt):
    """Hold --save-dir for this run (a lock file: a second run into it gets a clear error instead
    of racing this one's saves) and open the log; yields the log file (rank 0) or None. With
    --overwrite the earlier saves are deleted now, so that they cannot outrank this run's
    new ones in the keep-the-two-newest rule."""
    lock = log_file = None
    error = ""
    if rt.rank == 0:
        try:
            if cfg.save_dir:
                os.makedirs(cfg.save_dir, exist_ok=True)
                lock = take_lock(cfg.save_dir)
                if cfg.overwrite and not cfg.resume:
                    for old in os.listdir(cfg.save_dir):
                        if old.startswith("step_"):
                            shutil.rmtree(os.path.join(cfg.save_dir, old))
            # append when continuing; otherwise check_outputs found it empty or --overwrite
            if cfg.log:
                os.makedirs(parent_of(cfg.log), exist_ok=True)
                log_file = open(cfg.log, "a" if cfg.resume else "w")
        except (OSError, ValueError) as caught:
            error = str(caught)
    if rt.world > 1:  # every rank fails together, or the others would wait in a collective
        shared = [error]
        dist.broadcast_object_list(shared, src=0)
        error = shared[0]
    try:
        if error:
            raise ValueError(error)
        yield log_file
    finally:
        for f in (log_file, lock):
            if f is not None:
                f.close()  # closing the lock file releases the lock


def take_lock(save_dir: str):
    import fcntl

    path = os.path.join(save_dir, LOCK_NAME)
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise ValueError(f"--save-dir {save_dir!r} is in use by another run ({holder}); wait for "
                         f"it to end or choose another folder")
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    f.flush()
    return f


# ---------------------------------------------------------------------------------------------
# What a run leaves, step by step (train.py's loop): the log, saves when due, a stop, the export.
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def run_outputs(cfg, rt):
    """The run's Outputs, its --save-dir held and its log open (claim_outputs), signals that
    stop it noted (stop_signals)."""
    with claim_outputs(cfg, rt) as log_file, stop_signals(rt.rank) as stop:
        yield Outputs(cfg, rt, log_file, stop)


class Outputs:
    """A record per step in the log (rank 0), a saved state when one is due (every
    --save-every steps, after the last step, at a stop), the stop a signal asks for, and at the
    end the --export-hf folder. `last_saved`: the newest save's path."""

    def __init__(self, cfg, rt, log_file, stop: dict):
        self.cfg, self.rt, self.log_file, self.stop = cfg, rt, log_file, stop
        self.last_saved, self.stopped = None, False

    def log(self, record: dict) -> None:
        if self.log_file:
            self.log_file.write(json.dumps(record) + "\n")
            self.log_file.flush()

    def after_step(self, model, optimizer, step: int) -> bool:
        """Save when due; True when a signal stops the run, which every rank agrees on
        (any_rank): its state saved, the resume command printed."""
        cfg, done = self.cfg, step + 1
        self.stopped = any_rank("signal" in self.stop, self.rt)
        if cfg.save_dir and (self.stopped or done == cfg.steps
                             or (cfg.save_every and done % cfg.save_every == 0)):
            self.last_saved = save_state(cfg, self.rt, model, optimizer, done)
            if self.rt.rank == 0:
                tqdm.write(f"saved {self.last_saved}")
        if self.stopped:
            signal_name = self.stop.get("signal", "a signal to another rank")
            why = f"stopped by {signal_name} after step {step}"
            if not cfg.save_dir:  # nothing to continue from: not a success
                raise StopRequested(f"{why}: no checkpoint written (no --save-dir)")
            if self.rt.rank == 0:
                print(f"{why}: checkpoint {self.last_saved}; resume with:\n  "
                      f"{resume_command(sys.argv)}", flush=True)
        return self.stopped

    def finish(self, model, args) -> None:
        """--export-hf, on every rank (the export gathers each tensor from its shards); not
        after a stop, as the run is not finished. fp32 runs export fp32 (exact), GPU runs bf16,
        as published checkpoints are."""
        cfg = self.cfg
        if not cfg.export_hf or self.stopped:
            return
        pretrained.export_hf(model, args, cfg.export_hf, overwrite=cfg.overwrite_export,
                             dtype=getattr(torch, cfg.dtype), source_dir=cfg.init_from,
                             data_path=None if cfg.data == "synthetic" else cfg.data,
                             max_position_embeddings=max(cfg.seq_len, args.rope_original_context))
        if self.rt.rank == 0:
            print(f"exported {cfg.export_hf} (transformers: AutoModelForCausalLM.from_pretrained)")


# ---------------------------------------------------------------------------------------------
# SIGTERM / SIGINT: acknowledge at once, finish the step, save, exit 0 with the resume command.
# ---------------------------------------------------------------------------------------------

class StopRequested(Exception):
    pass


@contextlib.contextmanager
def stop_signals(rank: int = 0):
    """On SIGTERM or SIGINT remember the signal (yielded dict: {"signal": "SIGTERM"}); the loop
    stops after the current step, which every rank agrees on (any_rank).

    Schedulers signal every process (SLURM, Kubernetes), and torchrun forwards the signal it got
    to its workers as well, so a worker often gets two: the later ones are acknowledged and
    ignored, or a second SIGTERM would kill the rank in the middle of the save. (torchrun
    SIGKILLs its workers --shutdown-timeout seconds after its own signal, 30 by default: the
    step and the save must fit, or raise it.)

    The acknowledgement is immediate: Python runs a signal handler only when the main thread
    returns to the interpreter, which in a long backward or a GPU sync can be minutes. The C
    level handler writes the signal number to a pipe (signal.set_wakeup_fd) at once; a thread
    waiting on that pipe prints the line and sets the flag."""
    received = {}
    if threading.current_thread() is not threading.main_thread():
        yield received  # signals go to the main thread only; nothing to install
        return

    def note(signum):
        name = signal.Signals(signum).name
        if "signal" in received:
            message = f"{name} again: already stopping after this step (kill -9 stops at once)"
        else:
            received["signal"] = name
            message = f"{name} received: stopping after the current step, then saving"
        os.write(2, f"[rank {rank}] {message}\n".encode())

    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)

    def watch():
        while data := os.read(read_fd, 64):
            for signum in data:
                if signum in (signal.SIGTERM, signal.SIGINT):
                    note(signum)
        os.close(read_fd)

    previous = {s: signal.signal(s, lambda signum, frame: None)  # the thread does the work
                for s in (signal.SIGTERM, signal.SIGINT)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="stop-signals", daemon=True)
    watcher.start()
    try:
        yield received
    finally:
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_fd)  # the watcher reads end-of-file and ends
        watcher.join(timeout=5)


def resume_command(argv: list[str]) -> str:
    """The command that continues this run: the launcher's (torchrun's, read from /proc) or
    python's, with --resume added once. A run that exports (--export-hf) gets
    --overwrite-export too: the folder holds this run's own export by then, which the
    continued run replaces with its own at its end (written beside it, renamed into place)."""
    command = [os.path.basename(sys.executable), *argv]
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: its parent is the launcher
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                command = [a.decode() for a in f.read().split(b"\0") if a]
        except OSError:
            command = ["torchrun", "...", *argv]
    exports = any(a == "--export-hf" or a.startswith("--export-hf=") for a in command)
    added = ["--overwrite-export"] * (exports and "--overwrite-export" not in command)
    return shlex.join([a for a in command if a not in ("--resume", "--overwrite")]
                      + added + ["--resume"])


def any_rank(flag: bool, rt) -> bool:
    """True on every rank if it is true on one: ranks must stop after the same step, or the
    ones that go on would wait forever in the next collective."""
    if rt.world == 1:
        return flag
    value = torch.tensor([float(flag)], device=rt.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def barrier(rt):
    if rt.world > 1:
        dist.barrier()
