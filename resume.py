"""resume.py - save a training run and continue it: model, optimizer, RNG and step.

Not 03's activation checkpoints (block inputs kept for backward within one step): this file
writes the training state to disk so a run survives a crash, a time limit or a scheduler's
signal. Each rank writes only its own shards (torch.distributed.checkpoint), into a temporary
folder that becomes step_N by an atomic rename once every rank has finished; resuming restores
the newest complete one. The data position is the step, so nothing else is needed to continue
exactly (tests/test_resume.py: the resumed loss log equals an uninterrupted one, bit for bit).
"""

import contextlib
import json
import os
import shutil
import signal
import threading
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist


# ---------------------------------------------------------------------------------------------
# Saved training state: sharded (torch.distributed.checkpoint), atomic, resumable.
# ---------------------------------------------------------------------------------------------

def checkpoint_meta(cfg, rt, args, step: int) -> dict:
    return {"step": step, "model": cfg.model, "model_args": asdict(args),
            "world_size": rt.world, "sp": rt.sp, "seed": cfg.seed, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "data": cfg.data}


def save_checkpoint(cfg, rt, model, optimizer, step: int) -> str:
    """Write model + optimizer shards, RNG states and the step into save_dir/step_N.

    Everything goes into step_N.tmp first; only when every rank has written its part does rank 0
    rename it to step_N (a rename is atomic), so a crash mid-write leaves the previous checkpoint
    as the latest complete one. The two newest checkpoints are kept.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = os.path.join(cfg.save_dir, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rt.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier(rt)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with quiet_single_process_checkpoint():
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp)
    rng = {"cpu": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state(rt.device) if rt.device.type == "cuda" else None}
    torch.save(rng, os.path.join(tmp, f"rng_rank{rt.rank}.pt"))
    barrier(rt)
    if rt.rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(checkpoint_meta(cfg, rt, model.args, step), f, indent=1)
        if os.path.exists(final):  # the same step saved again (e.g. after a resume)
            shutil.rmtree(final)
        os.rename(tmp, final)
        for old in complete_checkpoints(cfg.save_dir)[:-2]:
            shutil.rmtree(old)
    barrier(rt)
    return final


def complete_checkpoints(save_dir: str) -> list[str]:
    """Complete checkpoints (renamed, with meta.json), oldest first."""
    if not os.path.isdir(save_dir):
        return []
    names = sorted(n for n in os.listdir(save_dir) if n.startswith("step_") and not n.endswith(".tmp"))
    paths = [os.path.join(save_dir, n) for n in names]
    return [p for p in paths if os.path.isfile(os.path.join(p, "meta.json"))]


def load_checkpoint(cfg, rt, model, optimizer) -> int:
    """Restore the latest complete checkpoint of save_dir; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = complete_checkpoints(cfg.save_dir)
    if not found:
        raise ValueError(f"--resume: no complete checkpoint in {cfg.save_dir!r}")
    path = found[-1]
    meta = checked_meta(path, model.args, "--resume")
    if meta["world_size"] != rt.world or meta["sp"] != rt.sp:
        raise ValueError(f"--resume: {path} was saved by {meta['world_size']} ranks with sp "
                         f"{meta['sp']}; this run has {rt.world} ranks with sp {rt.sp}")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with quiet_single_process_checkpoint():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    rng = torch.load(os.path.join(path, f"rng_rank{rt.rank}.pt"), weights_only=False)
    torch.set_rng_state(rng["cpu"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], rt.device)
    return meta["step"]


def checked_meta(path: str, args, flag: str) -> dict:
    """The checkpoint's meta.json, or a ValueError if it holds a model of another shape."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    model_args = asdict(args)
    if meta["model_args"] != model_args:
        changed = {k: (meta["model_args"].get(k), v) for k, v in model_args.items()
                   if meta["model_args"].get(k) != v}
        raise ValueError(f"{flag}: {path} holds a model of another shape "
                         f"({meta['model']}; differs in {changed} as (checkpoint, now))")
    return meta


def load_model_state(path: str, model, flag: str = "--save-dir") -> dict:
    """Only the model weights of a training checkpoint, for evaluation: `path` is a save dir
    (its newest complete checkpoint) or one step_N folder. No optimizer, RNG or step; any
    number of ranks and any sharding (torch.distributed.checkpoint reshards on load, unlike
    --resume, which needs the saving layout for the RNG states). Returns the meta, with "path"."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    if not os.path.isfile(os.path.join(path, "meta.json")):
        found = complete_checkpoints(path)
        if not found:
            raise ValueError(f"{flag}: no complete checkpoint in {path!r}")
        path = found[-1]
    meta = checked_meta(path, model.args, flag)
    state = {"model": get_model_state_dict(model)}
    with quiet_single_process_checkpoint():
        dcp.load(state, checkpoint_id=path)  # the optimizer's entries stay on disk
    set_model_state_dict(model, state["model"])
    return {**meta, "path": path}


@contextlib.contextmanager
def quiet_single_process_checkpoint():
    """torch.distributed.checkpoint warns when used without a process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def barrier(rt):
    if rt.world > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# SIGTERM / SIGINT: finish the step, save, exit non-zero.
# ---------------------------------------------------------------------------------------------

class StopRequested(Exception):
    pass


def install_stop_handlers() -> dict:
    """On SIGTERM or SIGINT remember the signal; the loop stops after the current step. A
    second signal gets the default behaviour (stop at once)."""
    received = {}

    def handler(signum, frame):
        received["signal"] = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)

    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, handler)
    return received


def any_rank(flag: bool, rt) -> bool:
    """True on every rank if it is true on one: ranks must stop after the same step, or the
    ones that go on would wait forever in the next collective."""
    if rt.world == 1:
        return flag
    value = torch.tensor([float(flag)], device=rt.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())
