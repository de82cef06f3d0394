"""train.py - compose the techniques of 01..05 and train.

    python train.py                                   # tiny model, synthetic data, CPU or GPU
    torchrun --nproc-per-node 8 train.py --model llama3-8b --seq-len 3M --stack 5

`--stack N` turns on everything up to file N (0 = plain training); each technique also has its
own switch. They are applied to the model in this order, before FSDP shards it:
  attention seam (02 Ulysses or 05 Untied Ulysses) -> tiling (04) -> checkpointing/offload (03)
  -> FSDP (01: each block, then the root)
which is the order torchtitan uses (checkpoint inside, FSDP outside).
"""

import argparse
import contextlib
import importlib
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import model as llama

# The numbered files start with a digit, so they are imported by name.
fsdp = importlib.import_module("01_fsdp")
ulysses = importlib.import_module("02_ulysses")
offload = importlib.import_module("03_checkpoint_offload")
tiling = importlib.import_module("04_alst_tiling")
untied = importlib.import_module("05_untied_ulysses")

# (flag, the first --stack level that turns it on)
TECHNIQUES = [("fsdp", 1), ("ulysses", 2), ("checkpoint", 3), ("offload", 3), ("tile_mlp", 4),
              ("tile_loss", 4), ("tile_norm", 4), ("untied", 5)]
MAX_STACK = 5


@dataclass
class Config:
    model: str = "tiny"
    seq_len: int = 256
    batch_size: int = 1
    steps: int = 100
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    dtype: str = "float32"
    data: str = "synthetic"
    data_dtype: str = "uint16"
    log: str | None = None
    stack: int | None = None
    fsdp: bool = False
    ulysses: bool = False
    sp: int | None = None  # sequence-parallel degree; default: all ranks
    checkpoint: bool = False
    offload: bool = False
    tile_mlp: bool = False
    tile_loss: bool = False
    tile_norm: bool = False
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    untied: bool = False
    head_chunk: int | None = None
    save_dir: str | None = None
    save_every: int = 0  # 0: only at the end (and when stopped by a signal)
    resume: bool = False


def parse_args(argv=None) -> Config:
    parser = argparse.ArgumentParser(description="Train a Llama on long sequences with 01..05.")
    d = Config()
    parser.add_argument("--model", default=d.model, help=f"preset: {', '.join(llama.PRESETS)}")
    parser.add_argument("--seq-len", default=str(d.seq_len), help="tokens per sequence: 4096, 128K, 3M")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per data-parallel rank")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 disables clipping")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--data", default=d.data, help="'synthetic' or a flat binary file of token ids")
    parser.add_argument("--data-dtype", choices=["uint16", "uint32"], default=d.data_dtype)
    # Not "--log": torchrun's own parser would take it for an abbreviation of its --log-dir.
    parser.add_argument("--log-file", dest="log", default=None, help="write JSON lines here")
    parser.add_argument("--stack", type=int, default=None, help="turn on every technique of files 1..N")
    parser.add_argument("--fsdp", action="store_true", help="01: shard params/grads/optimizer")
    parser.add_argument("--ulysses", action="store_true", help="02: Ulysses sequence parallelism")
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default: all ranks)")
    parser.add_argument("--checkpoint", action="store_true", help="03: activation checkpointing")
    parser.add_argument("--offload", action="store_true", help="03: offload checkpoints to CPU")
    parser.add_argument("--tile-mlp", action="store_true", help="04: tiled MLP")
    parser.add_argument("--tile-loss", action="store_true", help="04: tiled logits + loss")
    parser.add_argument("--tile-norm", action="store_true", help="04: tiled RMSNorms")
    parser.add_argument("--mlp-tile-tokens", type=int, default=None)
    parser.add_argument("--loss-tile-tokens", type=int, default=None)
    parser.add_argument("--untied", action="store_true", help="05: Untied Ulysses (headwise chunks)")
    parser.add_argument("--head-chunk", type=int, default=None,
                        help="05: query heads per stage (U); default: on a GPU the fewest stages "
                             "whose planned step fits, else the sp degree (least memory)")
    parser.add_argument("--save-dir", default=None, help="write sharded checkpoints here")
    parser.add_argument("--save-every", type=int, default=d.save_every,
                        help="checkpoint every N steps (default: only at the end and on SIGTERM)")
    parser.add_argument("--resume", action="store_true", help="continue from --save-dir's latest")
    parser.add_argument("--plan", action="store_true",
                        help="print the per-GPU memory plan instead of training (no GPU needed); "
                             "--seq-len max: the longest length per stack level")
    parser.add_argument("--gpus", type=int, default=None, help="--plan: GPUs planned for (default 8)")
    parser.add_argument("--gpu-mem", default=None, help="--plan: memory per GPU (default 80GiB)")
    parser.add_argument("--host-mem", default=None, help="--plan: host memory per node (default 2TiB)")
    ns = parser.parse_args(argv)
    if ns.plan or ns.gpus is not None or ns.gpu_mem is not None or ns.host_mem is not None:
        raise ValueError("--plan, --gpus, --gpu-mem and --host-mem plan memory instead of training: "
                         "run python train.py --plan ...")
    cfg = Config(**{k: v for k, v in vars(ns).items() if k in Config.__dataclass_fields__
                    and k not in ("seq_len", "dtype")})
    cfg.seq_len = ulysses.parse_tokens(ns.seq_len)
    cfg.dtype = ns.dtype or ("bfloat16" if cfg.device == "cuda" else "float32")
    return resolve_techniques(cfg)


def resolve_techniques(cfg: Config) -> Config:
    """Expand --stack and refuse combinations that cannot work."""
    if cfg.stack is not None:
        if not 0 <= cfg.stack <= MAX_STACK:
            raise ValueError(f"--stack must be between 0 and {MAX_STACK}, got {cfg.stack}")
        for flag, level in TECHNIQUES:
            if level <= cfg.stack:
                setattr(cfg, flag, True)
        if cfg.untied:
            cfg.ulysses = False  # 05 replaces 02 at the same seam
    if cfg.ulysses and cfg.untied:
        raise ValueError("--ulysses and --untied are alternatives for the same seam; pick one")
    if cfg.offload:
        cfg.checkpoint = True  # offload moves the checkpoints, so it implies checkpointing
    if cfg.head_chunk is not None and not cfg.untied:
        raise ValueError("--head-chunk is a setting of --untied (05)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here")
    if cfg.batch_size < 1 or cfg.steps < 0:
        raise ValueError("--batch-size must be >= 1 and --steps >= 0")
    if cfg.resume and not cfg.save_dir:
        raise ValueError("--resume needs --save-dir (where the checkpoints are)")
    if cfg.save_every < 0:
        raise ValueError("--save-every must be >= 0")
    llama.get_model_args(cfg.model)  # unknown preset: a clear error now
    return cfg


# ---------------------------------------------------------------------------------------------
# Processes: world = data-parallel x sequence-parallel
# ---------------------------------------------------------------------------------------------

@dataclass
class Runtime:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")
    dp_rank: int = 0
    dp: int = 1
    sp_rank: int = 0
    sp: int = 1
    sp_group: object = None
    fsdp_mesh: object = None


def setup_runtime(cfg: Config) -> Runtime:
    """Join (or start a one-process) process group when a technique needs one."""
    needs_group = cfg.fsdp or cfg.ulysses or cfg.untied
    launched = "WORLD_SIZE" in os.environ
    if not dist.is_initialized() and (launched or needs_group):
        if cfg.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        if launched:
            dist.init_process_group(backend)
        else:  # `python train.py --stack 5`: a group of one, its store in memory (no port)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rt = Runtime()
    if dist.is_initialized():
        rt.rank, rt.world = dist.get_rank(), dist.get_world_size()
    if cfg.device == "cuda":
        rt.device = torch.device("cuda", torch.cuda.current_device())
    rt.sp, _ = check_layout(cfg, rt.world, llama.get_model_args(cfg.model))
    if dist.is_initialized():
        mesh = ulysses.data_sequence_mesh(cfg.device, rt.sp)
        rt.dp_rank, rt.dp = mesh["dp"].get_local_rank(), mesh["dp"].size()
        rt.sp_rank, rt.sp_group = mesh["sp"].get_local_rank(), mesh["sp"].get_group()
        if cfg.fsdp:
            from torch.distributed.device_mesh import init_device_mesh

            rt.fsdp_mesh = init_device_mesh(cfg.device, (rt.world,))
    return rt


def check_layout(cfg: Config, world_size: int, args) -> tuple:
    """(sequence-parallel degree, head chunk) of `cfg` on `world_size` ranks, or a ValueError
    naming the constraint. Training runs it before building anything; --plan runs the same."""
    if world_size < 1:
        raise ValueError(f"--gpus must be at least 1, got {world_size}")
    if world_size > 1 and not cfg.fsdp:
        raise ValueError(f"{world_size} processes need --fsdp (01) to keep the model in sync; "
                         f"add --fsdp or --stack 1 or higher")
    sequence_parallel = cfg.ulysses or cfg.untied
    sp = (cfg.sp or world_size) if sequence_parallel else 1
    if cfg.sp is not None and not sequence_parallel:
        raise ValueError("--sp needs --ulysses or --untied")
    ulysses.check_data_sequence_layout(world_size, sp)
    if sequence_parallel:
        ulysses.check_ulysses_shapes(args.n_heads, args.n_kv_heads, sp, cfg.seq_len)
    head_chunk = (untied.check_head_chunk(args.n_heads, args.n_kv_heads, sp, cfg.head_chunk)
                  if cfg.untied else None)
    tiling.check_tile_tokens("mlp_tile_tokens", cfg.mlp_tile_tokens)
    tiling.check_tile_tokens("loss_tile_tokens", cfg.loss_tile_tokens)
    return sp, head_chunk


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def build_model(cfg: Config, rt: Runtime):
    """The model of `cfg` with its techniques applied, sharded and on the device. With --untied
    and no --head-chunk on a GPU it also fills in cfg.head_chunk (`fewest_stages_that_fit`)."""
    args = llama.get_model_args(cfg.model)
    dtype = getattr(torch, cfg.dtype)

    def apply_techniques(model):
        if cfg.ulysses:
            ulysses.apply_ulysses(model, rt.sp_group)
        if cfg.untied:
            if cfg.head_chunk is None and rt.device.type == "cuda":  # the choice is kept in cfg
                cfg.head_chunk = fewest_stages_that_fit(cfg, rt.world, smallest_gpu_memory(rt))
            untied.apply_untied_ulysses(model, rt.sp_group, cfg.head_chunk)
        if cfg.tile_mlp or cfg.tile_loss or cfg.tile_norm:
            tiling.apply_tiling(model, tile_mlp=cfg.tile_mlp, tile_loss=cfg.tile_loss,
                                mlp_tile_tokens=cfg.mlp_tile_tokens,
                                loss_tile_tokens=cfg.loss_tile_tokens, tile_norm=cfg.tile_norm)
        if cfg.checkpoint:
            offload.apply_checkpointing(model, offload=cfg.offload)

    # Draw weights whole on the CPU (identical to the unsharded model) while that is cheap;
    # the big presets draw each rank's shard on its device.
    exact = llama.num_params(args) < 2e8
    return fsdp.build_model(args, rt.device, rt.fsdp_mesh if cfg.fsdp else None, dtype,
                            seed=cfg.seed, exact_init=exact, before_sharding=apply_techniques)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

class TokenData:
    """Batches of (batch_size, seq_len + 1) token ids for one data-parallel rank.

    'synthetic': each sequence is an arithmetic progression modulo the vocabulary with a random
    start and stride, so a model that learns to attend to the previous two tokens can predict it
    (the loss goes down within a few steps). A file: flat little-endian uint16 or uint32 ids,
    read through a memory map; consecutive windows of seq_len + 1 tokens.
    """

    def __init__(self, cfg: Config, vocab_size: int, dp_rank: int, dp: int):
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


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------

def forward_backward(model, tokens: torch.Tensor, rt: Runtime, labels=None) -> torch.Tensor:
    """Loss (global token mean, detached) after backward on this rank's part of `tokens`
    (B, S + 1); `labels` (B, S) default to the tokens shifted by one."""
    input_ids, labels, positions = ulysses.shard_sequence(tokens.to(rt.device), rt.sp_rank, rt.sp,
                                                          None if labels is None else labels.to(rt.device))
    world_group = dist.group.WORLD if rt.world > 1 else None
    n_tokens = ulysses.global_token_count(labels, world_group)
    with out_of_memory_names("forward"):
        loss = model(input_ids, positions, labels) / n_tokens
    with out_of_memory_names("backward"):
        loss.backward()
    loss = loss.detach()
    if world_group is not None:
        dist.all_reduce(loss, group=world_group)  # every rank's share of the mean, added up
    return loss


def make_optimizer(model, cfg: Config):
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             betas=(0.9, 0.95), foreach=False)


def train_step(model, optimizer, tokens, rt: Runtime, cfg: Config, labels=None, step: int = 0) -> dict:
    """One optimizer step. A non-finite loss or gradient raises before the weights change."""
    loss = float(forward_backward(model, tokens, rt, labels))
    # The global gradient norm (clip_grad_norm_ reduces over FSDP shards); inf = measure only.
    max_norm = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at "
                                 f"step {step}; the weights were not updated")
    with out_of_memory_names("optimizer step"):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"loss": loss, "grad_norm": grad_norm}


# ---------------------------------------------------------------------------------------------
# Failing clearly: out of memory names its phase and the next technique to turn on.
# ---------------------------------------------------------------------------------------------

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
        raise StepOutOfMemory(f"out of GPU memory in the {phase}: {str(error).splitlines()[0]}") from error


def next_memory_technique(cfg: Config, sp: int) -> str:
    """What to turn on next when a step does not fit, in the order of the files."""
    if not cfg.fsdp:
        return "--fsdp (01: shard the model state)"
    if not (cfg.ulysses or cfg.untied):
        return "--ulysses (02: split the sequence over the GPUs)"
    if not cfg.checkpoint:
        return "--checkpoint (03: keep only each block's input for backward)"
    if not cfg.offload:
        return "--offload (03: move those inputs to CPU memory)"
    if not (cfg.tile_mlp and cfg.tile_loss and cfg.tile_norm):
        return "--tile-mlp --tile-loss --tile-norm (04: no sequence-wide MLP, logits or norm buffers)"
    if not cfg.untied:
        return "--untied (05: one head chunk of Q/K/V resident at a time)"
    if cfg.head_chunk and cfg.head_chunk > sp:
        return f"a smaller --head-chunk (down to {sp})"
    return "fewer tokens per GPU: a shorter --seq-len or more GPUs"


def out_of_memory_report(error: Exception, cfg: Config, rt: "Runtime") -> str:
    summary = ""
    if torch.cuda.is_available():
        summary = (f"\npeak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB of "
                   f"{torch.cuda.get_device_properties(rt.device).total_memory / 2**30:.1f} GiB; "
                   f"allocator summary:\n{torch.cuda.memory_summary(rt.device, abbreviated=True)}")
    return f"{error}{summary}\nnext: try {next_memory_technique(cfg, rt.sp)}"


# ---------------------------------------------------------------------------------------------
# Checkpoints: sharded (torch.distributed.checkpoint), atomic, resumable.
# ---------------------------------------------------------------------------------------------

def checkpoint_meta(cfg: Config, rt: Runtime, step: int) -> dict:
    return {"step": step, "model": cfg.model, "model_args": asdict(llama.get_model_args(cfg.model)),
            "world_size": rt.world, "sp": rt.sp, "seed": cfg.seed, "seq_len": cfg.seq_len,
            "batch_size": cfg.batch_size, "data": cfg.data}


def save_checkpoint(cfg: Config, rt: Runtime, model, optimizer, step: int) -> str:
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
            json.dump(checkpoint_meta(cfg, rt, step), f, indent=1)
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


def load_checkpoint(cfg: Config, rt: Runtime, model, optimizer) -> int:
    """Restore the latest complete checkpoint of save_dir; returns the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    found = complete_checkpoints(cfg.save_dir)
    if not found:
        raise ValueError(f"--resume: no complete checkpoint in {cfg.save_dir!r}")
    path = found[-1]
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    model_args = asdict(llama.get_model_args(cfg.model))
    if meta["model_args"] != model_args:
        changed = {k: (meta["model_args"].get(k), v) for k, v in model_args.items()
                   if meta["model_args"].get(k) != v}
        raise ValueError(f"--resume: {path} holds a model of another shape "
                         f"({meta['model']}; differs in {changed} as (checkpoint, now))")
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


@contextlib.contextmanager
def quiet_single_process_checkpoint():
    """torch.distributed.checkpoint warns when used without a process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def barrier(rt: Runtime):
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


def any_rank(flag: bool, rt: Runtime) -> bool:
    """True on every rank if it is true on one: ranks must stop after the same step, or the
    ones that go on would wait forever in the next collective."""
    if rt.world == 1:
        return flag
    value = torch.tensor([float(flag)], device=rt.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


# ---------------------------------------------------------------------------------------------
# Memory planner: `python train.py --plan ...` adds up the bytes each numbered file states,
# without a GPU. Calibrated on GPU runs: docs/calibration.md.
# ---------------------------------------------------------------------------------------------

GiB = 2**30
# What a GPU cannot hand to tensors: the CUDA context, NCCL and cuBLAS workspaces, the
# allocator's slack. On a 139.8 GiB H200 a step failed to allocate 0.9 GiB with 136.85 GiB
# allocated (docs/results/progression_llama3-8b_2gpu.json): 2.95 GiB was out of reach.
PLAN_GPU_RESERVE = 3 * GiB
PLAN_COMPONENTS = {  # component -> (label, label when nothing is checkpointed)
    "saved": ("checkpoints on GPU", "other layers' activations (norms, MLP)"),
    "block": ("one block's recompute + temporaries", None),
    "loss": ("loss temporaries", None),
    "fsdp": ("FSDP gathered params / unsharded grads", None),
    "optimizer": ("optimizer step temporaries", None),
}


def parse_bytes(text: str) -> int:
    """'80GiB', '141GiB', '2TiB', '512GB', '1.5T' -> bytes. KiB/MiB/GiB/TiB and a bare K/M/G/T
    are powers of 2; KB/MB/GB/TB powers of 10."""
    value = str(text).strip()
    units = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "TB": 10**12, "GB": 10**9,
             "MB": 10**6, "KB": 10**3, "T": 2**40, "G": 2**30, "M": 2**20, "K": 2**10, "B": 1}
    unit = next((u for u in units if value.upper().endswith(u)), "")
    try:
        number = float(value[:len(value) - len(unit)]) if unit else None
    except ValueError:
        number = None
    if number is None:
        raise ValueError(f"cannot read a memory size from {text!r} (try 80GiB, 2TiB or 512GB)")
    if not number > 0:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(number * units[unit])


def plan_memory(cfg: Config, world_size: int, args=None, adam_allocated: bool = True) -> dict:
    """Per-GPU bytes of one training step of `cfg` on `world_size` GPUs, at the moments where
    the step can peak, by component; every count comes from a numbered file's byte function.

      end of forward (loss):      what forward keeps (checkpoints, or every layer's
                                  activations) and the loss's temporaries;
      backward of the last layer: all checkpoints still on the GPU, one block's backward;
      backward of layer 0:        one checkpoint left, the other layers' gradients;
      end of backward:            the root's gradients on their way to the reduce-scatter;
      optimizer step:             the whole model state and AdamW's temporaries.
    One block's backward peaks at its MLP, its post-attention RMSNorm or its attention.
    adam_allocated=False: the first step, whose optimizer step allocates Adam's moments.
    Returns {"moments": {moment: {component: bytes}}, "peak_moment", "peak", "block_moment",
    "host" (pinned bytes per GPU), "model_state", "local_tokens", "sp", "dp", "head_chunk"}.
    """
    args = args or llama.get_model_args(cfg.model)
    sp, head_chunk = check_layout(cfg, world_size, args)
    b = getattr(torch, cfg.dtype).itemsize
    tokens = cfg.batch_size * cfg.seq_len  # per data-parallel rank
    local_tokens = tokens // sp
    hidden = local_tokens * args.dim * b  # a block's input or output, or its gradient
    n_layers = args.n_layers
    n_params = llama.num_params(args)
    block_params = (n_params - llama.num_params(replace(args, n_layers=0))) // max(n_layers, 1)
    largest = max(args.vocab_size, args.ffn_dim, args.n_heads * args.head_dim) * args.dim
    if cfg.fsdp:  # fp32 master weights, gradients and Adam, sharded; bf16 copies gathered
        state = fsdp.model_state_bytes(args, world_size)
        buffers = fsdp.fsdp_buffer_bytes(args, b)
        optimizer_temporaries = 2 * 4 * -(-largest // world_size)
    else:  # one process: the model, its gradients and Adam's two moments in the compute dtype
        state = {"parameters": b * n_params, "gradients": b * n_params, "optimizer": 2 * b * n_params}
        buffers = dict.fromkeys(("after_forward", "during_backward", "end_of_backward"), 0)
        optimizer_temporaries = 2 * b * largest
    # AdamW (foreach=False) updates one parameter at a time with two temporaries of its size.

    if cfg.untied:
        attention = partial(untied.untied_attention_bytes, args, tokens, sp, head_chunk, b)
    else:
        attention = partial(ulysses.attention_activation_bytes, args, tokens, sp, b)
    mlp = partial(tiling.mlp_temporary_bytes, args, local_tokens, cfg.tile_mlp,
                  cfg.mlp_tile_tokens, b)
    attention_saved, mlp_saved = attention(saved_only=True), mlp(saved_only=True)
    norms = (tiling.norm_temporary_bytes(args, local_tokens, cfg.mlp_tile_tokens, b) if cfg.tile_norm
             else offload.block_recompute_bytes(args, local_tokens, b))
    loss = tiling.loss_temporary_bytes(args, local_tokens, cfg.tile_loss, cfg.loss_tile_tokens, b)

    # One block's backward, after checkpointing rebuilt what it saved: (attention, the rest).
    # The gradient of its output stays until its first RMSNorm's input gradient is added to it.
    first_norm = norms["first_norm"]  # kept until the block's input gradient is done
    # At Ulysses' kernel backward two token-layout tensors of its standalone count are gone in
    # a block: o_proj's input (o_proj's backward ran first) and the output gradient (exchanged
    # into the head layout, then dropped). Untied Ulysses keeps both: it saved its output and
    # slices the output gradient stage by stage. (Measured at 128K-1M, docs/calibration.md.)
    token_layout = (local_tokens * args.n_heads * args.head_dim * b
                    if cfg.ulysses and not cfg.untied and sp > 1 else 0)
    block_moments = {
        "its MLP": (attention_saved, norms["saved"] + hidden + mlp()),
        "its post-attention RMSNorm": (attention_saved, first_norm + norms["post_norm_input"]
                                       + 2 * hidden + norms["norm_backward"]),
        "its attention": (attention() - token_layout, first_norm + 2 * hidden - token_layout),
    }
    block_moment = max(block_moments, key=lambda m: sum(block_moments[m]))
    block_attention, block_rest = block_moments[block_moment]

    params, grads = state["parameters"], state["gradients"]
    adam = state["optimizer"] if adam_allocated else 0
    if cfg.checkpoint:
        checkpoints = offload.checkpoint_memory_bytes(args, tokens, sp, cfg.offload, b, pinned=True)
        host = checkpoints["host"]
        forward_kept = {"saved": checkpoints["gpu"], "attention": 0}
        # Offloaded: backward starts with the last input and brings the next one back (if
        # there is a next one: a one-layer model keeps its only input on the GPU).
        prefetched = hidden if cfg.offload and n_layers > 1 else 0
        last_layer_kept = {"saved": checkpoints["gpu"] + prefetched,
                           "attention": 0}
        first_layer_kept = {"saved": hidden, "attention": 0}
    else:  # every layer keeps its activations until backward reaches it
        host = 0
        layer = norms["saved"] + norms["block_input"] + mlp_saved
        forward_kept = {"saved": n_layers * layer, "attention": n_layers * attention_saved}
        # In the running block's backward, what a tiled norm saved of its input is still there
        # (with checkpointing that input is the checkpoint, counted above).
        last_layer_kept = {"saved": (n_layers - 1) * layer + norms["block_input"],
                           "attention": (n_layers - 1) * attention_saved}
        first_layer_kept = {"saved": norms["block_input"], "attention": 0}

    def backward_of(kept, model_state):
        return {"model_state": model_state, "attention": kept["attention"] + block_attention,
                "saved": kept["saved"], "block": block_rest, "fsdp": buffers["during_backward"]}

    other_block_grads = (n_layers - 1) * grads * block_params // n_params
    moments = {
        "end of forward (loss)": {"model_state": params + adam, **forward_kept, "loss": loss,
                                  "fsdp": buffers["after_forward"]},
        "backward of the last layer": backward_of(last_layer_kept, params + adam),
        "backward of layer 0": backward_of(first_layer_kept, params + adam + other_block_grads),
        "end of backward": {"model_state": params + adam + grads,
                            "fsdp": buffers["end_of_backward"]},
        "optimizer step": {"model_state": params + grads + state["optimizer"],
                           "optimizer": optimizer_temporaries},
    }
    peak_moment = max(moments, key=lambda m: sum(moments[m].values()))
    return {"moments": moments, "peak_moment": peak_moment,
            "peak": sum(moments[peak_moment].values()), "block_moment": block_moment,
            "host": host, "model_state": sum(state.values()), "local_tokens": local_tokens,
            "sp": sp, "dp": world_size // sp, "head_chunk": head_chunk}


def smallest_gpu_memory(rt: Runtime) -> int:
    """The smallest GPU's memory over all ranks: choices made from it are the same on every rank
    (a head chunk that differed between ranks would mismatch the all-to-alls)."""
    memory = torch.tensor([torch.cuda.get_device_properties(rt.device).total_memory], device=rt.device)
    if dist.is_initialized():
        dist.all_reduce(memory, op=dist.ReduceOp.MIN)
    return int(memory.item())


def fewest_stages_that_fit(cfg: Config, world_size: int, gpu_mem: int) -> int:
    """Untied Ulysses' head chunk U when --head-chunk is not given, on a GPU: the largest valid
    U (fewest stages) whose planned step stays within 90% of the usable memory, else U = P.
    Fewer, bigger stages run faster (bigger kernels and matmuls, fewer exchanges: at 128K on
    2 H200s one stage ran 2310 tokens/s per GPU, U = P 2206, side by side in one run,
    docs/results/throughput_llama3-8b_2gpu_chunks.json);
    the memory that U = P saves matters only near the longest length that fits, and there
    only U = P fits. The tenth kept spare covers the planner's error (within 4%, calibration).
    One stage holds more memory than Ulysses (its backward keeps the output and the input-
    gradient buffer besides every head's q, k, v): it is chosen only where that fits. Training
    passes the memory torch reports (139.8 GiB on an H200); --plan passes --gpu-mem."""
    args = llama.get_model_args(cfg.model)
    sp, least_memory = check_layout(replace(cfg, head_chunk=None), world_size, args)
    for chunk in sorted(untied.valid_head_chunks(args, sp), reverse=True):
        plan = plan_memory(replace(cfg, head_chunk=chunk), world_size, args)
        if plan["peak"] <= 0.9 * (gpu_mem - PLAN_GPU_RESERVE):
            return chunk
    return least_memory


def plan_fits(plan: dict, world_size: int, gpu_mem: int, host_mem: int) -> tuple:
    """(fits on each GPU, fits in host memory): the peak within the GPU less PLAN_GPU_RESERVE;
    the offloaded checkpoints of all `world_size` GPUs within the node's host memory."""
    return plan["peak"] <= gpu_mem - PLAN_GPU_RESERVE, plan["host"] * world_size <= host_mem


def plan_longest_seq_len(cfg: Config, world_size: int, gpu_mem: int, host_mem: int,
                         limit: int = 2**28):
    """(longest sequence length that fits, its plan): the largest multiple of sp x 1,024 tokens
    (so every rank gets whole K-token shards) up to `limit` whose plan fits on the GPUs and the
    host; (0, None) when none does. Raises training's ValueError for an impossible setup."""
    sp, _ = check_layout(replace(cfg, seq_len=None), world_size, llama.get_model_args(cfg.model))
    step = sp * 1024

    def plan_at(multiple):
        plan = plan_memory(replace(cfg, seq_len=multiple * step), world_size)
        return plan if all(plan_fits(plan, world_size, gpu_mem, host_mem)) else None

    low, high, best = 0, limit // step, None  # memory grows with the length: bisect
    while low < high:
        middle = (low + high + 1) // 2
        plan = plan_at(middle)
        if plan is None:
            high = middle - 1
        else:
            low, best = middle, plan
    return low * step, best


def plan_tokens_text(n: int) -> str:
    short = (f"{n // 2**20}M" if n % 2**20 == 0 else f"{n / 2**20:.2f}M" if n >= 2**20
             else f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}")
    return f"{n:,} ({short})"


def plan_flags_text(cfg: Config, head_chunk) -> str:
    names = [f for f, _ in TECHNIQUES if getattr(cfg, f)]
    return ", ".join(f"untied (U={head_chunk})" if f == "untied" else f for f in names) or "none"


def plan_peak_text(plan: dict) -> str:
    """Where the step peaks: the moment, and within a block's backward the part of the block."""
    moment = plan["peak_moment"]
    return moment + (f" (at {plan['block_moment']})" if moment.startswith("backward of") else "")


def plan_table(cfg: Config, world_size: int, gpu_mem: int, host_mem: int) -> str:
    """The per-GPU table of `train.py --plan` for cfg.seq_len."""
    args = llama.get_model_args(cfg.model)
    if cfg.untied and cfg.head_chunk is None:  # what training on such GPUs would choose
        cfg = replace(cfg, head_chunk=fewest_stages_that_fit(cfg, world_size, gpu_mem))
    plan = plan_memory(cfg, world_size)
    gpu_fits, host_fits = plan_fits(plan, world_size, gpu_mem, host_mem)
    peak = plan["moments"][plan["peak_moment"]]
    gpus = f"{world_size} GPU{'s' if world_size > 1 else ''}"
    row = lambda label, n: f"{label:<48}{n / GiB:9.1f}"  # noqa: E731
    label_column = 0 if cfg.checkpoint else 1
    other = {PLAN_COMPONENTS[c][label_column] or PLAN_COMPONENTS[c][0]: peak.get(c, 0)
             for c in PLAN_COMPONENTS if c in peak or c != "optimizer"}
    usable = gpu_mem - PLAN_GPU_RESERVE
    lines = [
        f"{cfg.model} ({llama.num_params(args) / 1e9:.2f}B parameters): "
        f"{plan_tokens_text(cfg.seq_len)} tokens x batch {cfg.batch_size}, {cfg.dtype}; {gpus} "
        f"(data {plan['dp']} x sequence {plan['sp']}), {plan['local_tokens']:,} tokens per GPU",
        f"techniques: {plan_flags_text(cfg, plan['head_chunk'])}",
        f"{'per GPU':<48}{'GiB':>9}",
        row("model state (params, grads, Adam) at the peak", peak["model_state"])
        + f"   (all of it: {plan['model_state'] / GiB:.1f})",
        row("attention activations", peak.get("attention", 0)),
        row("other", sum(other.values())),
        "    " + "; ".join(f"{label} {n / GiB:.1f}" for label, n in other.items()),
        row("total at the peak", plan["peak"])
        + f"   {'fits' if gpu_fits else 'does NOT fit'} in {usable / GiB:.1f} usable of "
        f"{gpu_mem / GiB:.1f}",
        f"    peak: {plan_peak_text(plan)}",
        row("host RAM per GPU (offloaded checkpoints)", plan["host"])
        + f"   {'fits' if host_fits else 'does NOT fit'} in {host_mem / world_size / GiB:.1f} "
        f"({host_mem / GiB:.1f} per node / {gpus})",
        "other moments: " + ", ".join(f"{m} {sum(c.values()) / GiB:.1f}" for m, c
                                      in plan["moments"].items() if m != plan["peak_moment"]),
    ]
    return "\n".join(lines)


def plan_levels(cfg: Config):
    """(label, config) for each stack level 0..5, with Untied Ulysses next to Ulysses at levels 2
    and 3 (level 5 is level 4 with it), and level 4 without sequence parallelism (--sp 1); cfg's
    other flags (batch size, head chunk, --sp, tile sizes, dtype) kept."""
    techniques = {flag: False for flag, _ in TECHNIQUES}
    base = replace(cfg, stack=None, sp=None, head_chunk=None, **techniques)
    rows = []
    for level in range(MAX_STACK + 1):
        for use_untied in ((False, True) if level in (2, 3) else (level == 5,)):
            label = f"--stack {level}" + (" --untied" if use_untied and level < 5 else "")
            rows.append((label, replace(base, stack=level, untied=use_untied,
                                        sp=cfg.sp if level >= 2 else None,
                                        head_chunk=cfg.head_chunk if use_untied else None)))
    rows.append(("--stack 4 --sp 1 (no context parallelism)", replace(base, stack=4, sp=1)))
    return rows


def plan_longest_table(cfg: Config, world_size: int, gpu_mem: int, host_mem: int) -> str:
    """The table of `train.py --plan --seq-len max`: the longest length per stack level."""
    lines = [f"longest sequence that fits: {cfg.model}, {world_size} GPUs x {gpu_mem / GiB:.1f} GiB "
             f"({(gpu_mem - PLAN_GPU_RESERVE) / GiB:.1f} usable), host {host_mem / GiB:.1f} GiB per "
             f"node, {cfg.dtype}, batch {cfg.batch_size}; lengths are multiples of sp x 1,024 tokens",
             f"{'flags':<44}{'sp':>3}  {'longest (tokens)':<22}{'peak GiB':>9}"
             f"{'host GiB/GPU':>13}  peak at"]
    for label, level_cfg in plan_levels(cfg):
        try:
            level_cfg = resolve_techniques(level_cfg)
            length, plan = plan_longest_seq_len(level_cfg, world_size, gpu_mem, host_mem)
        except ValueError as error:
            lines.append(f"{label:<44}  -  impossible: {error}")
            continue
        if plan is None:
            lines.append(f"{label:<44}{'':>3}  none fits (not even sp x 1,024 tokens)")
            continue
        label = label.replace("--stack 5", f"--stack 5 (U={plan['head_chunk']})")
        lines.append(f"{label:<44}{plan['sp']:>3}  {plan_tokens_text(length):<22}"
                     f"{plan['peak'] / GiB:>9.1f}{plan['host'] / GiB:>13.1f}  {plan_peak_text(plan)}")
    return "\n".join(lines)


def plan_main(argv) -> str:
    """`python train.py --plan ...`: the per-GPU table at --seq-len, or with --seq-len max the
    longest length per stack level. The other flags apply as in training; the compute dtype
    defaults to bfloat16 (the GPUs')."""
    parser = argparse.ArgumentParser(allow_abbrev=False, add_help=False)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-mem", default="80GiB")
    parser.add_argument("--host-mem", default="2TiB")
    parser.add_argument("--seq-len", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    opts, train_argv = parser.parse_known_args(argv)
    longest = str(opts.seq_len).strip().lower() == "max"
    if opts.seq_len is not None and not longest:
        train_argv += ["--seq-len", opts.seq_len]
    cfg = parse_args(train_argv + ["--dtype", opts.dtype])
    gpu_mem, host_mem = parse_bytes(opts.gpu_mem), parse_bytes(opts.host_mem)
    if longest:
        return plan_longest_table(cfg, opts.gpus, gpu_mem, host_mem)
    return plan_table(cfg, opts.gpus, gpu_mem, host_mem)


# ---------------------------------------------------------------------------------------------
# Main loop
# ---------------------------------------------------------------------------------------------

def attention_kernel(cfg: Config, rt: Runtime, args) -> str:
    """The kernel each rank's attention runs, for the log: 05's kernel with log-sum-exp, or the
    one causal_attention picks for the heads a rank holds after the exchange."""
    dtype = getattr(torch, cfg.dtype)
    if cfg.untied:
        q = torch.empty(1, 1, 1, args.head_dim, device=rt.device, dtype=dtype)
        return f"{untied.lse_kernel(q)[0]} (with log-sum-exp, 05)"
    return llama.attention_kernel_name(rt.device, dtype, args.n_heads // rt.sp,
                                       max(args.n_kv_heads // rt.sp, 1), args.head_dim)


@dataclass
class Run:
    history: list
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def train(cfg: Config) -> Run:
    rt = setup_runtime(cfg)
    args = llama.get_model_args(cfg.model)
    data = TokenData(cfg, args.vocab_size, rt.dp_rank, rt.dp)
    model = build_model(cfg, rt)
    optimizer = make_optimizer(model, cfg)
    first_step = load_checkpoint(cfg, rt, model, optimizer) if cfg.resume else 0
    stop = install_stop_handlers()
    is_main = rt.rank == 0
    log_file = open(cfg.log, "a" if cfg.resume else "w") if (cfg.log and is_main) else None
    header = {"config": asdict(cfg), "world_size": rt.world, "dp": rt.dp, "sp": rt.sp,
              "torch": torch.__version__,
              "attention_kernel": attention_kernel(cfg, rt, args),
              "parameters": llama.num_params(args), "first_step": first_step}
    if is_main:
        print(f"{cfg.model}: {header['parameters'] / 1e6:.1f}M params, {cfg.seq_len:,} tokens, "
              f"world {rt.world} (dp {rt.dp} x sp {rt.sp}), {cfg.dtype} on {cfg.device}, "
              f"attention: {header['attention_kernel']}, techniques: "
              f"{plan_flags_text(cfg, cfg.head_chunk or rt.sp)}"
              + (f", resumed at step {first_step}" if cfg.resume else ""))
    if log_file:
        log_file.write(json.dumps(header) + "\n")
    history = []
    tokens_per_gpu = cfg.batch_size * cfg.seq_len * rt.dp / rt.world
    # The bar only on a terminal: written into a log file it would garble the step lines.
    show_bar = is_main and sys.stderr.isatty()
    per = "gpu" if rt.device.type == "cuda" else "rank"
    for step in tqdm(range(first_step, cfg.steps), disable=not show_bar, desc="train", leave=False):
        tokens = data.batch(step)  # the data position is the step: resuming needs nothing more
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            metrics = train_step(model, optimizer, tokens, rt, cfg, step=step)
        except StepOutOfMemory as error:
            raise StepOutOfMemory(out_of_memory_report(error, cfg, rt)) from error
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        record = {"step": step, **metrics, "step_time_s": round(step_time, 4),
                  "tokens_per_s_per_gpu": round(tokens_per_gpu / step_time, 1),
                  "peak_gpu_mem_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 3)
                                       if rt.device.type == "cuda" else None)}
        history.append(record)
        if is_main:
            mem = f" | peak {record['peak_gpu_mem_gib']:.2f} GiB" if record["peak_gpu_mem_gib"] else ""
            tqdm.write(f"step {step:4d} | loss {record['loss']:.4f} | "
                       f"{record['tokens_per_s_per_gpu']:,.0f} tok/s/{per} | {step_time:.3f}s{mem}")
            if log_file:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
        stopping = any_rank("signal" in stop, rt)
        done = step + 1
        if cfg.save_dir and (stopping or done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            path = save_checkpoint(cfg, rt, model, optimizer, done)
            if is_main:
                tqdm.write(f"saved {path}")
        if stopping:
            where = (f"checkpoint {os.path.join(cfg.save_dir, f'step_{done:08d}')}; resume with "
                     f"the same command plus --resume" if cfg.save_dir else
                     "no checkpoint written (no --save-dir)")
            raise StopRequested(f"stopped by {stop.get('signal', 'another rank')} after step {step}: {where}")
    if log_file:
        log_file.close()
    return Run(history, model, optimizer)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--plan" in argv:
        try:
            print(plan_main(argv))
        except ValueError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(1)
        return
    try:
        train(parse_args(argv))
    except (ValueError, FloatingPointError, StepOutOfMemory, StopRequested) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
