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
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from support import kernels
import model as llama
from support import pretrained
from support import saved_state
from support.data import TokenData, parse_tokens

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
MAX_TOKENS = 2**31  # per data-parallel rank and step


@dataclass
class Config:
    model: str = "tiny"
    seq_len: int = 256
    batch_size: int = 1
    steps: int = 100
    lr: float = 3e-3
    warmup_steps: int = 0  # the learning rate rises linearly to --lr over this many steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str = field(default_factory=lambda: "cuda" if torch.cuda.is_available() else "cpu")
    dtype: str = "float32"
    data: str = "synthetic"
    data_dtype: str | None = None  # default: the token file's sidecar, else uint16
    documents: bool = False  # packed documents: positions, labels and attention per document
    doc_sep: int | None = None  # the token that ends a document (default: sidecar, model EOS)
    log: str | None = None
    stack: int | None = None
    fsdp: bool = False
    ulysses: bool = False
    sp: int | None = None  # sequence-parallel degree; default: all ranks
    checkpoint: bool = False
    offload: bool = False
    keep_attention: bool = False  # 03: attention outputs kept through the checkpoint
    tile_mlp: bool = False
    tile_loss: bool = False
    tile_norm: bool = False
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    untied: bool = False
    head_chunk: int | None = None
    offload_model_state: bool = False  # 01: params, grads and Adam on the host (any level >= 1)
    save_dir: str | None = None
    save_every: int = 0  # 0: only at the end (and when stopped by a signal)
    resume: bool = False
    overwrite: bool = False  # replace an earlier run's checkpoints and log
    attn_kernel: str = "auto"  # kernels.py: auto, fa4, cudnn, flash, math
    init_from: str | None = None  # a Hugging Face model folder: its shape and weights
    export_hf: str | None = None  # write a Hugging Face folder here at the end
    overwrite_export: bool = False
    rope_theta: float | None = None  # rotary settings to train with (default: the model's)
    rope_scaling: str | None = None
    rope_factor: float | None = None
    rope_original_context: int | None = None


def parse_args(argv=None) -> Config:
    parser = argparse.ArgumentParser(description="Train a Llama on long sequences with 01..05.")
    d = Config()
    parser.add_argument("--model", default=d.model, help=f"preset: {', '.join(llama.PRESETS)}")
    parser.add_argument("--seq-len", default=str(d.seq_len), help="tokens per sequence: 4096, 128K, 3M")
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per data-parallel rank")
    parser.add_argument("--steps", type=int, default=d.steps)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                        help="raise the learning rate linearly to --lr over the first N steps")
    parser.add_argument("--weight-decay", type=float, default=d.weight_decay)
    parser.add_argument("--grad-clip", type=float, default=d.grad_clip, help="0 disables clipping")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--data", default=d.data, help="'synthetic' or a flat binary file of token ids")
    parser.add_argument("--data-dtype", choices=["uint16", "uint32"], default=d.data_dtype,
                        help="token id type of --data (default: its .json sidecar, else uint16)")
    parser.add_argument("--documents", action="store_true",
                        help="the data is packed documents: each one trained on its own (rotary "
                             "positions restart, no attention or label across a boundary); "
                             "boundaries from --data's .docs index or the separator token")
    parser.add_argument("--doc-sep", type=int, default=None,
                        help="token id that ends each document (implies --documents; default: "
                             "the data's sidecar, else the model preset's EOS id)")
    # Not "--log": torchrun's own parser would take it for an abbreviation of its --log-dir.
    parser.add_argument("--log-file", dest="log", default=None, help="write JSON lines here")
    parser.add_argument("--stack", type=int, default=None, help="turn on every technique of files 1..N")
    parser.add_argument("--fsdp", action="store_true", help="01: shard params/grads/optimizer")
    parser.add_argument("--ulysses", action="store_true", help="02: Ulysses sequence parallelism")
    parser.add_argument("--sp", type=int, default=None, help="sequence-parallel degree (default: all ranks)")
    parser.add_argument("--checkpoint", action="store_true", help="03: activation checkpointing")
    parser.add_argument("--offload", action="store_true", help="03: offload checkpoints to CPU")
    parser.add_argument("--keep-attention", action="store_true",
                        help="03: keep each block's attention output (and log-sum-exp) with its "
                             "checkpoint, so backward's recompute skips the attention kernel: "
                             "faster at long lengths, one more block input's bytes per layer")
    parser.add_argument("--tile-mlp", action="store_true", help="04: tiled MLP")
    parser.add_argument("--tile-loss", action="store_true", help="04: tiled logits + loss")
    parser.add_argument("--tile-norm", action="store_true", help="04: tiled RMSNorms")
    parser.add_argument("--mlp-tile-tokens", type=int, default=None)
    parser.add_argument("--loss-tile-tokens", type=int, default=None)
    parser.add_argument("--untied", action="store_true", help="05: Untied Ulysses (headwise chunks)")
    parser.add_argument("--head-chunk", type=int, default=None,
                        help="05: query heads per stage (U); default: on a GPU the fewest stages "
                             "whose planned step fits, else the sp degree (least memory)")
    parser.add_argument("--offload-model-state", action="store_true",
                        help="01: keep the sharded parameters, gradients and optimizer in host "
                             "memory and step the optimizer there (FSDP2's CPUOffloadPolicy)")
    parser.add_argument("--save-dir", default=None, help="write sharded checkpoints here")
    parser.add_argument("--save-every", type=int, default=d.save_every,
                        help="checkpoint every N steps (default: only at the end and on SIGTERM)")
    parser.add_argument("--resume", action="store_true", help="continue from --save-dir's latest")
    parser.add_argument("--overwrite", action="store_true",
                        help="delete the checkpoints in --save-dir and replace --log-file, from an "
                             "earlier run (without it such a run is refused)")
    parser.add_argument("--attn-kernel", choices=kernels.KERNELS, default=d.attn_kernel,
                        help="attention kernel (default: FlashAttention-4 when installed on the "
                             "GPU, else cuDNN; the run log names it)")
    parser.add_argument("--init-from", default=None, metavar="DIR",
                        help="start from a Hugging Face Llama/Qwen3 folder (config.json + safetensors)")
    parser.add_argument("--export-hf", default=None, metavar="DIR",
                        help="at the end, write a Hugging Face folder that transformers loads")
    parser.add_argument("--overwrite-export", action="store_true",
                        help="let --export-hf replace a folder that is not empty")
    parser.add_argument("--rope-theta", type=float, default=None, help="rotary base (context extension)")
    parser.add_argument("--rope-scaling", choices=llama.ROPE_SCALINGS, default=None,
                        help="rotary scaling, with Hugging Face's meaning (default: the model's)")
    parser.add_argument("--rope-factor", type=float, default=None, help="llama3/yarn: stretch factor")
    parser.add_argument("--rope-original-context", type=int, default=None,
                        help="llama3/yarn: the context length the model was pretrained at")
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
    cfg.seq_len = parse_tokens(ns.seq_len)
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
    if cfg.keep_attention and not cfg.checkpoint:
        raise ValueError("--keep-attention is a setting of --checkpoint (03): add --checkpoint, "
                         "--offload or --stack 3 or higher")
    if cfg.doc_sep is not None:
        cfg.documents = True
    if cfg.head_chunk is not None and not cfg.untied:
        raise ValueError("--head-chunk is a setting of --untied (05)")
    if cfg.offload_model_state and not cfg.fsdp:
        raise ValueError("--offload-model-state is a setting of --fsdp (01): add --fsdp or "
                         "--stack 1 or higher")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here")
    if cfg.batch_size < 1 or cfg.steps < 0 or cfg.warmup_steps < 0:
        raise ValueError("--batch-size must be >= 1, --steps and --warmup-steps >= 0")
    if cfg.sp is not None and cfg.sp < 1:  # 0 would silently mean "all ranks"
        raise ValueError(f"--sp must be at least 1, got {cfg.sp}")
    if cfg.seq_len is not None and cfg.seq_len * cfg.batch_size > MAX_TOKENS:
        raise ValueError(f"--seq-len {cfg.seq_len} x --batch-size {cfg.batch_size} is more than "
                         f"{MAX_TOKENS:,} tokens (2^31: positions are 32-bit in the kernels)")
    for flag, value in (("--lr", cfg.lr), ("--weight-decay", cfg.weight_decay),
                        ("--grad-clip", cfg.grad_clip)):
        if not (math.isfinite(value) and value >= 0):  # a negative clip would silently mean off
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}"
                             + (" (0 turns clipping off)" if flag == "--grad-clip" else ""))
    if cfg.resume and not cfg.save_dir:
        raise ValueError("--resume needs --save-dir (where the checkpoints are)")
    if cfg.resume and cfg.overwrite:
        raise ValueError("--resume continues the checkpoints that --overwrite deletes; pick one")
    if cfg.save_every < 0:
        raise ValueError("--save-every must be >= 0")
    if cfg.export_hf:
        pretrained.check_export_dir(cfg.export_hf, cfg.overwrite_export)
    model_args(cfg)  # an unknown preset or an unsupported Hugging Face config: a clear error now
    return cfg


def model_args(cfg: Config) -> llama.ModelArgs:
    """The model's shape: --init-from's config.json, else the --model preset; with the rotary
    settings of the --rope-* flags (context extension changes these, not the weights)."""
    args = (pretrained.model_args_from_hf(cfg.init_from) if cfg.init_from
            else llama.get_model_args(cfg.model))
    rope = {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "rope_factor": cfg.rope_factor, "rope_original_context": cfg.rope_original_context}
    return replace(args, **{k: v for k, v in rope.items() if v is not None})


def model_name(cfg: Config) -> str:
    """What the logs call the model: the --init-from folder, else the --model preset."""
    return f"{cfg.init_from} (Hugging Face folder)" if cfg.init_from else cfg.model


def techniques_text(cfg: Config, head_chunk) -> str:
    names = [f for f, _ in TECHNIQUES if getattr(cfg, f)]
    names += ["keep_attention"] if cfg.keep_attention else []
    names += ["offload_model_state"] if cfg.offload_model_state else []
    return ", ".join(f"untied (U={head_chunk})" if f == "untied" else f for f in names) or "none"


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
        if cfg.device == "cuda" and cfg.offload_model_state:
            # Gradient clipping reduces the norms of the host-resident gradient shards: CPU
            # tensors, which NCCL cannot reduce; gloo takes those.
            backend = "cpu:gloo,cuda:nccl"
        if launched:
            dist.init_process_group(backend)
        else:  # `python train.py --stack 5`: a group of one, its store in memory (no port)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    kernels.use_kernel(cfg.attn_kernel)
    rt = Runtime()
    if dist.is_initialized():
        rt.rank, rt.world = dist.get_rank(), dist.get_world_size()
    if cfg.device == "cuda":
        rt.device = torch.device("cuda", torch.cuda.current_device())
    rt.sp, _ = check_layout(cfg, rt.world, model_args(cfg))
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

def choose_head_chunk(cfg: Config, rt: Runtime, forward_only: bool = False) -> int | None:
    """Untied Ulysses' head chunk U for this run: --head-chunk, else on GPUs the fewest stages
    whose planned step (forward_only: evaluation's forward) fits the smallest GPU
    (plan.fewest_stages_that_fit), else U = P (least memory; 05's default). Every rank decides
    the same: the all-to-alls must match."""
    if not cfg.untied or cfg.head_chunk is not None or rt.device.type != "cuda":
        return cfg.head_chunk
    import plan  # here, not at the top: plan.py imports this file for Config

    return plan.fewest_stages_that_fit(cfg, rt.world, plan.smallest_gpu_memory(rt), forward_only)


def available_host_memory() -> int | None:
    """Bytes the host can still hand out: Linux's MemAvailable, or less where a container's
    memory limit (cgroup v2) leaves less; None where unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as limit, open("/sys/fs/cgroup/memory.current") as used:
            available = min(available, int(limit.read()) - int(used.read()))
    except (OSError, ValueError):  # no cgroup v2, or "max": no limit
        pass
    return available


def host_memory_error(cfg: Config, world: int, local_ranks: int, available: int | None) -> str | None:
    """Why the planned host memory of this node's ranks does not fit in `available` bytes, or
    None. Offloading (03's checkpoints, --keep-attention's outputs, 01's model state) puts
    hundreds of GiB on the host at long lengths; too many and the kernel kills a rank mid-step."""
    if not (cfg.offload or cfg.offload_model_state) or available is None:
        return None
    import plan  # here, not at the top: plan.py imports this file for Config

    planned = plan.plan_memory(cfg, world)
    need = planned["host"] * local_ranks
    if need <= available:
        return None
    parts = ", ".join(f"{name} {nbytes / 2**30:.1f}" for name, nbytes in planned["host_parts"].items() if nbytes)
    return (f"the host memory planned for this node's {local_ranks} rank(s), {need / 2**30:.1f} GiB "
            f"({parts} GiB per rank), is more than the {available / 2**30:.1f} GiB available"
            + ("; --keep-attention doubles the offloaded checkpoints: drop it" if cfg.keep_attention else "")
            + "; or use more GPUs or a shorter --seq-len (python plan.py with the same flags shows the plan)")


def build_model(cfg: Config, rt: Runtime):
    """The model of `cfg` with its techniques applied, sharded and on the device; with
    --init-from its weights are read from the folder, each rank only its shard."""
    args = model_args(cfg)
    dtype = getattr(torch, cfg.dtype)

    def apply_techniques(model):  # the composition order: seam (02/05) -> 04 -> 03; then 01
        if cfg.ulysses:
            ulysses.apply_ulysses(model, rt.sp_group)
        if cfg.untied:
            untied.apply_untied_ulysses(model, rt.sp_group, cfg.head_chunk)
        if cfg.tile_mlp or cfg.tile_loss or cfg.tile_norm:
            tiling.apply_tiling(model, tile_mlp=cfg.tile_mlp, tile_loss=cfg.tile_loss,
                                mlp_tile_tokens=cfg.mlp_tile_tokens,
                                loss_tile_tokens=cfg.loss_tile_tokens, tile_norm=cfg.tile_norm)
        if cfg.checkpoint:
            offload.apply_checkpointing(model, offload=cfg.offload, keep_attention=cfg.keep_attention)

    mesh = rt.fsdp_mesh if cfg.fsdp else None
    if cfg.init_from:
        return pretrained.build_from_hf(cfg.init_from, rt.device, mesh, dtype,
                                        before_sharding=apply_techniques, args=args,
                                        offload_model_state=cfg.offload_model_state)[0]
    # Draw weights whole on the CPU (identical to the unsharded model) while that is cheap;
    # the big presets draw each rank's shard on its device.
    exact = llama.num_params(args) < 2e8
    return fsdp.build_model(args, rt.device, mesh, dtype, seed=cfg.seed, exact_init=exact,
                            before_sharding=apply_techniques,
                            offload_model_state=cfg.offload_model_state)


# ---------------------------------------------------------------------------------------------
# One step
# ---------------------------------------------------------------------------------------------

def forward_backward(model, tokens: torch.Tensor, rt: Runtime, labels=None,
                     documents=None) -> torch.Tensor:
    """Loss (global token mean, detached) after backward on this rank's part of `tokens`
    (B, S + 1): 02's sharded step, with an out-of-memory error naming its phase. documents:
    the packed documents of `tokens` (data.Documents), None for one document per row."""
    world_group = dist.group.WORLD if rt.world > 1 else None
    return ulysses.loss_and_backward(model, tokens.to(rt.device), rt.sp_rank, rt.sp, world_group,
                                     None if labels is None else labels.to(rt.device),
                                     phase=out_of_memory_names, documents=documents)


def make_optimizer(model, cfg: Config):
    """AdamW. State on the GPU: foreach=False, one parameter at a time (bounded temporaries);
    state on the host (--offload-model-state): 01's fused CPU AdamW, with the rank's cores."""
    adamw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if cfg.offload_model_state:
        return fsdp.host_optimizer(model.parameters(), **adamw)
    return torch.optim.AdamW(model.parameters(), foreach=False, **adamw)


def learning_rate(cfg: Config, step: int) -> float:
    """--lr after a linear warmup. A function of the step alone, so resuming needs no state."""
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr


def train_step(model, optimizer, tokens, rt: Runtime, cfg: Config, labels=None, step: int = 0,
               documents=None) -> dict:
    """One optimizer step. A non-finite loss or gradient raises before the weights change."""
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, step)
    loss = float(forward_backward(model, tokens, rt, labels, documents))
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


# ---------------------------------------------------------------------------------------------
# Main loop
# ---------------------------------------------------------------------------------------------

def attention_kernel(cfg: Config, rt: Runtime, args) -> str:
    """The kernel attention runs (for the log); 05 and --keep-attention call its forward and
    backward separately."""
    name = kernels.attention_kernel_name(rt.device, getattr(torch, cfg.dtype), args.head_dim)
    if cfg.untied or cfg.keep_attention:
        name += f" (forward and backward with log-sum-exp, {'05' if cfg.untied else '03'})"
    return name


@dataclass
class Run:
    history: list
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def train(cfg: Config) -> Run:
    rt = setup_runtime(cfg)
    saved_state.check_outputs(cfg)  # every output path, before anything is written
    args = model_args(cfg)
    data = TokenData(cfg, args.vocab_size, rt.dp_rank, rt.dp, eos_id=args.eos_id)
    # Before claiming the outputs: --overwrite deletes an earlier run's checkpoints and log there,
    # which a run refused for its host memory must not have done.
    cfg.head_chunk = choose_head_chunk(cfg, rt)
    check_host_memory(cfg, rt)
    with saved_state.claim_outputs(cfg, rt) as log_file, saved_state.stop_signals(rt.rank) as stop:
        return train_loop(cfg, rt, args, data, log_file, stop)


def check_host_memory(cfg: Config, rt: Runtime) -> None:
    """`host_memory_error` for a GPU run (pinned host buffers; on a CPU they are the activations'
    own memory), with the least memory any rank sees, so that every rank decides the same."""
    if rt.device.type != "cuda" or not (cfg.offload or cfg.offload_model_state):
        return
    available = torch.tensor([available_host_memory() or -1], device=rt.device)
    if dist.is_initialized():
        dist.all_reduce(available, op=dist.ReduceOp.MIN)
    if available.item() < 0:  # unknown somewhere: not refused
        return
    error = host_memory_error(cfg, rt.world, int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                              int(available.item()))
    if error:
        raise ValueError(error)


def train_loop(cfg: Config, rt: Runtime, args, data: TokenData, log_file, stop: dict) -> Run:
    if cfg.untied and rt.rank == 0:
        print(f"Untied Ulysses: {args.n_heads // (cfg.head_chunk or rt.sp)} stages of "
              f"U = {cfg.head_chunk or rt.sp} query heads")
    model = build_model(cfg, rt)
    optimizer = make_optimizer(model, cfg)
    first_step = saved_state.load_checkpoint(cfg, rt, model, optimizer) if cfg.resume else 0
    is_main = rt.rank == 0
    header = {"config": asdict(cfg), "world_size": rt.world, "dp": rt.dp, "sp": rt.sp,
              "torch": torch.__version__,
              "attention_kernel": attention_kernel(cfg, rt, args),
              "parameters": llama.num_params(args), "first_step": first_step}
    if is_main:
        print(f"{model_name(cfg)}: {header['parameters'] / 1e6:.1f}M params, {cfg.seq_len:,} tokens, "
              f"world {rt.world} (dp {rt.dp} x sp {rt.sp}), {cfg.dtype} on {cfg.device}, "
              f"attention: {header['attention_kernel']}, techniques: "
              f"{techniques_text(cfg, cfg.head_chunk or rt.sp)}"
              + ((", packed documents (" + (f"separator {data.separator}" if data.separator is not None
                                             else "boundary index") + ")") if cfg.documents else "")
              + (f", resumed at step {first_step}" if cfg.resume else ""))
        if data.documents_ignored:
            print(f"note: {cfg.data} lists its documents (sidecar or .docs index), but without "
                  f"--documents each window trains as one sequence: documents attend to each other")
    if log_file:
        log_file.write(json.dumps(header) + "\n")
    history = []
    tokens_per_gpu = cfg.batch_size * cfg.seq_len * rt.dp / rt.world
    # The bar only on a terminal: written into a log file it would garble the step lines.
    show_bar = is_main and sys.stderr.isatty()
    per = "gpu" if rt.device.type == "cuda" else "rank"
    for step in tqdm(range(first_step, cfg.steps), disable=not show_bar, desc="train", leave=False):
        tokens = data.batch(step)  # the data position is the step: resuming needs nothing more
        documents = data.documents(step, tokens)  # None unless --documents
        if rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            metrics = train_step(model, optimizer, tokens, rt, cfg, step=step, documents=documents)
        except StepOutOfMemory as error:
            import plan  # here, not at the top: plan.py imports this file for Config

            raise StepOutOfMemory(plan.out_of_memory_report(error, cfg, rt)) from error
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        step_time = time.perf_counter() - start
        record = {"step": step, **metrics, "step_time_s": round(step_time, 4),
                  **({"documents": documents.count} if documents is not None else {}),
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
        stopping = saved_state.any_rank("signal" in stop, rt)  # every rank stops after the same step
        done = step + 1
        if cfg.save_dir and (stopping or done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
            path = saved_state.save_checkpoint(cfg, rt, model, optimizer, done)
            if is_main:
                tqdm.write(f"saved {path}")
        if stopping:
            why = f"stopped by {stop.get('signal', 'a signal to another rank')} after step {step}"
            if not cfg.save_dir:  # nothing to continue from: not a success
                raise saved_state.StopRequested(f"{why}: no checkpoint written (no --save-dir)")
            if is_main:
                print(f"{why}: checkpoint {path}; resume with:\n  "
                      f"{saved_state.resume_command(sys.argv)}", flush=True)
            return Run(history, model, optimizer)  # no export: the run is not finished
    if cfg.export_hf:  # every rank: the export gathers each tensor from its shards
        # fp32 runs export fp32 (exact); GPU runs bf16, as published checkpoints are.
        pretrained.export_hf(model, args, cfg.export_hf, overwrite=cfg.overwrite_export,
                             dtype=getattr(torch, cfg.dtype), source_dir=cfg.init_from,  # the context it was trained for:
                             max_position_embeddings=max(cfg.seq_len, args.rope_original_context))
        if is_main:
            print(f"exported {cfg.export_hf} (transformers: AutoModelForCausalLM.from_pretrained)")
    return Run(history, model, optimizer)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--plan" in argv:  # the memory planner, plan.py, with the same flags
        import plan

        return plan.main(argv)
    exit_on_error(lambda: train(parse_args(argv)))


def exit_on_error(run) -> None:
    """run(); a failure we explain (bad input, a non-finite step, out of memory, a stop) ends
    the process with `error: ...` and exit code 1, no traceback. The process group goes either way."""
    try:
        run()
    except (ValueError, FloatingPointError, StepOutOfMemory, saved_state.StopRequested,
            saved_state.SaveFailed) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
