"""config.py - what a run is: the Config, the flags that fill it, and which techniques they mean.

Data and parsing only: nothing here imports a technique (01-06); support/runtime.py checks a
Config against the ranks and the techniques' own constraints. Each flag is defined once, in one
of the groups below; each command (train.py, eval.py, plan.py) adds the groups it reads, so its
--help lists only its own flags. `--stack N` turns on every technique of files 1..N.
"""

import argparse
import math
from dataclasses import dataclass, field, replace

import torch

from model import PRESETS, ROPE_SCALINGS, ModelArgs, get_model_args, num_params
from base import kernels
from support import pretrained
from support.data import parse_tokens

# (flag, the first --stack level that turns it on)
# (--tile-norm is no level's: on CUDA F.rms_norm is one fused kernel that keeps what a tiled norm
# keeps, so tiling the norms there only adds a recompute; it pays where the norm runs op by op.)
TECHNIQUES = [("fsdp", 1), ("ulysses", 2), ("checkpoint", 3), ("offload", 3), ("tile_mlp", 4),
              ("tile_loss", 4), ("untied", 5)]
MAX_STACK = 5
UNTIED_LEVEL = dict(TECHNIQUES)["untied"]  # from here 05 takes 02's seam
MAX_STEPS = 2**31  # (tqdm and the schedule's arithmetic want a C long; nobody trains longer)
AUTO = "auto"  # --stack auto: the planner picks the techniques (plan.plan_run)
MAX_TOKENS = 2**31  # per data-parallel rank and micro-batch
ADAMW_BETAS = (0.9, 0.95)  # the recipe's AdamW (train.make_optimizer; bench/peers steps with it)
# The flags that choose techniques or their settings: a GPU run given none of them takes
# --stack auto; under auto each one given is kept (a constraint on what the planner ranks).
TECHNIQUE_FIELDS = ("stack", *(flag for flag, _ in TECHNIQUES), "tile_norm", "offload_model_state",
                    "ring", "checkpoint_layers", "keep_attention", "mlp_tile_tokens",
                    "loss_tile_tokens", "head_chunk", "offload_activations")


@dataclass
class Config:
    model: str = "tiny"
    seq_len: int = 256
    batch_size: int = 1
    steps: int = 100
    grad_accum: int = 1  # micro-batches of batch_size sequences per optimizer step
    lr: float | None = None  # the peak learning rate; None: default_lr (by model size)
    warmup_steps: int = 0  # the learning rate rises linearly to --lr over this many steps
    lr_schedule: str = "constant"  # after the warmup: constant, or decaying to min_lr at --steps
    min_lr: float | None = None  # where cosine/linear end; None: MIN_LR_FRACTION x lr
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
    stack: int | str | None = None  # a level 0..MAX_STACK, or AUTO
    fsdp: bool = False
    ulysses: bool = False
    sp: int | None = None  # sequence-parallel degree; default: all ranks
    ring: int | None = None  # 06: ring degree R (Ulysses P/R x ring R); default: ring_degree
    checkpoint: bool = False
    offload: bool = False
    checkpoint_layers: int | None = None  # 03: checkpoint the first K blocks; None: all
    keep_attention: bool | None = None  # 03: attention outputs kept through the checkpoint;
    # None: decided on a GPU, from the plan (plan.plan_run; off on the CPU)
    offload_activations: int = 0  # 07: N blocks, every other one above 03's checkpointed ones,
    # keep what they saved in host memory
    tile_mlp: bool = False
    tile_loss: bool = False
    tile_norm: bool = False
    mlp_tile_tokens: int | None = None
    loss_tile_tokens: int | None = None
    untied: bool = False
    head_chunk: int | None = None
    offload_model_state: bool = False  # 01: params, grads and Adam on the host (any level >= 1)
    overlap_optimizer: bool | None = None  # 08: each block's AdamW update behind its next
    # forward; None: decided on a GPU, from the predicted step (plan.plan_run; off on the CPU)
    offload_moments: bool | None = None  # 09: the blocks' Adam moments in host memory, streamed
    # through the GPU for 08's updates (implies 08); None: off (--stack auto weighs it once given)
    save_dir: str | None = None
    save_every: int = 0  # 0: only at the end (and when stopped by a signal)
    resume: bool = False
    overwrite: bool = False  # replace an earlier run's saved states and log
    attn_kernel: str = "auto"  # kernels.py: auto, fa4, cudnn, flash, math
    init_from: str | None = None  # a Hugging Face model folder: its shape and weights
    export_hf: str | None = None  # write a Hugging Face folder here at the end
    overwrite_export: bool = False
    rope_theta: float | None = None  # rotary settings to train with (default: the model's)
    rope_scaling: str | None = None
    rope_factor: float | None = None
    rope_original_context: int | None = None


# The flags' defaults; --device's is Config().device, found when parsing.
DEFAULTS = Config(device="cpu")

# --lr's default by model size: the step that trains the tiny model fast diverged Llama-3-8B
# at its second step. (fewer parameters than, lr); from a pretrained --init-from folder
# (fine-tuning, context extension) the weights are already good: a small step.
DEFAULT_LRS = ((1e8, 3e-3), (7e9, 3e-4), (math.inf, 1.5e-4))
INIT_FROM_LR = 2e-5
LR_SCHEDULES = ("constant", "cosine", "linear")
MIN_LR_FRACTION = 0.1  # --min-lr's default: a tenth of --lr (nanoGPT, Chinchilla)


# ---------------------------------------------------------------------------------------------
# The flags, in groups: a command adds the groups it reads.
# ---------------------------------------------------------------------------------------------

def add_model_flags(parser):
    group = parser.add_argument_group("model")
    # default None: --model given with --init-from is refused (the folder names the model)
    group.add_argument("--model", default=None,
                       help=f"preset: {', '.join(PRESETS)} (default: {DEFAULTS.model})")
    group.add_argument("--init-from", default=None, metavar="DIR",
                       help="start from a Hugging Face Llama/Qwen3 folder (config.json + "
                            "safetensors); it names the model, so no --model")


def add_rotary_flags(parser):
    group = parser.add_argument_group(
        "rotary positions (context extension changes these, not the weights)")
    group.add_argument("--rope-theta", type=float, default=None,
                       help="rotary base (context extension)")
    group.add_argument("--rope-scaling", choices=ROPE_SCALINGS, default=None,
                       help="rotary scaling, with Hugging Face's meaning (default: the model's)")
    group.add_argument("--rope-factor", type=float, default=None,
                       help="llama3/yarn: stretch factor")
    group.add_argument("--rope-original-context", type=int, default=None,
                       help="llama3/yarn: the context length the model was pretrained at")


def add_step_flags(parser):
    group = parser.add_argument_group("the step's shape")
    group.add_argument("--seq-len", default=str(DEFAULTS.seq_len),
                       help="tokens per sequence: 4096, 128K, 3M (default: %(default)s)")
    group.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size,
                       help="sequences per data-parallel rank and micro-batch "
                            "(default: %(default)s)")
    group.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                       help="compute dtype (default: bfloat16 on a GPU, float32 on the CPU; "
                            "plan.py: bfloat16)")
    group.add_argument("--attn-kernel", choices=kernels.KERNELS, default=DEFAULTS.attn_kernel,
                       help="attention kernel (default: FlashAttention-4 when installed on the "
                            "GPU, else cuDNN; the run log names it; plan.py plans the kernel "
                            "this machine would pick: name fa4 to plan a GPU machine's)")


def add_accumulation_flags(parser):
    group = parser.add_argument_group("gradient accumulation")
    group.add_argument("--grad-accum", type=int, default=DEFAULTS.grad_accum, metavar="N",
                       help="N micro-batches of --batch-size sequences per optimizer step: the "
                            "same step as --batch-size x N, holding one micro-batch's "
                            "activations at a time (the gradients stay between micro-batches)")


def add_process_flags(parser):
    group = parser.add_argument_group("process")
    group.add_argument("--device", choices=["cpu", "cuda"], default=Config().device,
                       help="default: cuda when a GPU is visible, else cpu")
    group.add_argument("--seed", type=int, default=DEFAULTS.seed,
                       help="of the random init, the data's draws and torch's generators "
                            "(each rank its own stream) (default: %(default)s)")


def add_data_flags(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--data", default=DEFAULTS.data,
                       help="'synthetic' or a flat binary file of token ids")
    group.add_argument("--data-dtype", choices=["uint16", "uint32"], default=None,
                       help="token id type of --data (default: its .json sidecar, else uint16)")


def add_document_flags(parser):
    group = parser.add_argument_group("packed documents")
    group.add_argument("--documents", action="store_true",
                       help="the data is packed documents: each one trained on its own (rotary "
                            "positions restart, no attention or label across a boundary); "
                            "boundaries from --data's .docs index or the separator token "
                            "(plan.py: planned as dense windows, noting what documents add)")
    group.add_argument("--doc-sep", type=int, default=None,
                       help="token id that ends each document (implies --documents; default: "
                            "the data's sidecar, else the model preset's EOS id)")


def add_technique_flags(parser):
    group = parser.add_argument_group("techniques (01-09)")
    group.add_argument("--stack", type=stack_flag, default=None,
                       help="0-5, each level adds to the one below: 1 --fsdp, 2 --ulysses, "
                            "3 --checkpoint --offload, 4 --tile-mlp --tile-loss, 5 --untied in "
                            "place of --ulysses; never --tile-norm, --offload-model-state or "
                            "--ring (their own flags). auto: the fastest configuration the "
                            "planner fits (the technique flags given are kept); a GPU run with "
                            "no technique flag takes it")
    group.add_argument("--fsdp", action="store_true", help="01: shard params/grads/optimizer")
    group.add_argument("--offload-model-state", action="store_true",
                       help="01: keep the sharded parameters, gradients and optimizer in host "
                            "memory and step the optimizer there (FSDP2's CPUOffloadPolicy)")
    group.add_argument("--ulysses", action="store_true", help="02: Ulysses sequence parallelism")
    group.add_argument("--sp", type=int, default=None,
                       help="sequence-parallel degree (default: all ranks)")
    group.add_argument("--ring", type=int, default=None,
                       help="06: ring attention over R ranks, Ulysses over the P/R inside each "
                            "(the heads need only divide P/R); default: 1, or the smallest R "
                            "that works when the heads do not divide P")
    group.add_argument("--checkpoint", action="store_true", help="03: activation checkpointing")
    group.add_argument("--offload", action="store_true",
                       help="03: offload checkpoints to CPU (implies --checkpoint)")
    group.add_argument("--checkpoint-layers", type=int, default=None, metavar="K",
                       help="03: checkpoint (and offload) only the first K blocks; the others "
                            "keep their activations and skip the recompute (default: on a GPU "
                            "the fewest the plan fits, said in a line; else all)")
    group.add_argument("--keep-attention", action=argparse.BooleanOptionalAction, default=None,
                       help="03: keep each block's attention output (and log-sum-exp) with its "
                            "checkpoint, so backward's recompute skips the attention kernel: "
                            "faster at long lengths, one more block input's bytes per layer "
                            "(default: on for a GPU run that checkpoints when the plan says GPU "
                            "and host memory fit it; off on the CPU)")
    group.add_argument("--offload-activations", type=int, default=0, metavar="N",
                       help="07: N blocks, every other one from the first that 03 leaves "
                            "unchecked (a kept block above each), keep what they saved for "
                            "backward in host memory, copied out and back beside the compute, "
                            "instead of on the GPU; not chosen by --stack auto yet (not yet "
                            "measured on a GPU)")
    group.add_argument("--overlap-optimizer", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="08: each block's AdamW update on a side stream, behind that "
                            "block's next forward: the same weights bit for bit, the forward "
                            "holding the gradients of the blocks it has not reached (default: "
                            "on for a GPU run with FSDP and AdamW on the GPU where the speed "
                            "model predicts it 0.5%% faster or more; off on the CPU)")
    group.add_argument("--offload-moments", action=argparse.BooleanOptionalAction, default=None,
                       help="09: the blocks' AdamW moments wait in host memory, each block's "
                            "copied in for its update (08's, behind its next forward) and back: "
                            "the same weights bit for bit, 8 bytes a parameter off the GPU "
                            "outside the forward; --stack auto takes it where predicted 1%% "
                            "faster or more than every plan without it (on one H100, "
                            "Llama-3.2-3B at 32K and 64K: 1.4%% and 3.1%% faster), and where "
                            "nothing fits without it")
    group.add_argument("--tile-mlp", action="store_true", help="04: tiled MLP")
    group.add_argument("--tile-loss", action="store_true", help="04: tiled logits + loss")
    group.add_argument("--tile-norm", action="store_true",
                       help="04: tiled RMSNorms; not in --stack: on CUDA F.rms_norm is one fused "
                            "kernel that keeps what a tiled norm keeps, so tiling pays only "
                            "where the norm runs op by op")
    group.add_argument("--mlp-tile-tokens", type=int, default=None,
                       help="04: tokens per MLP tile, and per norm tile (default: on a GPU the "
                            "largest of 32K, 16K and 8K tokens the plan fits, said in a line; "
                            "else about the model's dim)")
    group.add_argument("--loss-tile-tokens", type=int, default=None,
                       help="04: tokens per loss tile (default: at most 1 GiB of fp32 logits)")
    group.add_argument("--untied", action="store_true", help="05: Untied Ulysses (headwise chunks)")
    group.add_argument("--head-chunk", type=int, default=None,
                       help="05: query heads per stage (U); default: on a GPU the fewest stages "
                            "whose planned step fits, else the sp degree (least memory)")


def add_training_flags(parser):
    group = parser.add_argument_group("training")
    group.add_argument("--steps", type=int, default=DEFAULTS.steps,
                       help="optimizer steps (default: %(default)s)")
    counts = [f"{limit / 1e9:g}B" if limit >= 1e9 else f"{limit / 1e6:g}M"
              for limit, _ in DEFAULT_LRS[:-1]]
    sizes = ", ".join([f"{lr:g} below {count} parameters"
                       for count, (_, lr) in zip(counts, DEFAULT_LRS)]
                      + [f"{DEFAULT_LRS[-1][1]:g} from {counts[-1]} (llama3-8b)"])
    group.add_argument("--lr", type=float, default=None,
                       help=f"peak learning rate (default by model size: {sizes}; "
                            f"{INIT_FROM_LR:g} with --init-from)")
    group.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps,
                       help="raise the learning rate linearly to --lr over the first N steps")
    group.add_argument("--lr-schedule", choices=LR_SCHEDULES, default=DEFAULTS.lr_schedule,
                       help="after the warmup: constant, or cosine/linear decay from --lr to "
                            "--min-lr at --steps")
    group.add_argument("--min-lr", type=float, default=None,
                       help=f"where cosine/linear end (default: {MIN_LR_FRACTION:g} x --lr)")
    group.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay,
                       help="AdamW's (default: %(default)s)")
    group.add_argument("--grad-clip", type=float, default=DEFAULTS.grad_clip,
                       help="the gradients' global norm at most this; 0 disables clipping "
                            "(default: %(default)s)")
    # Not "--log": torchrun's own parser would take it for an abbreviation of its --log-dir.
    group.add_argument("--log-file", dest="log", default=None, metavar="PATH",
                       help="write JSON lines here")


def add_saved_state_flags(parser, writes: bool = True):
    """writes=False: --save-dir alone, read (eval.py evaluates a run's saved model)."""
    group = parser.add_argument_group("saved training state (step_N folders)")
    if not writes:
        group.add_argument("--save-dir", default=None,
                           help="the model weights of a run's saved state: its newest complete "
                                "step_N, or one step_N folder (default: random init)")
        return
    group.add_argument("--save-dir", default=None,
                       help="save the training state here (step_N folders)")
    group.add_argument("--save-every", type=int, default=DEFAULTS.save_every,
                       help="save every N steps (default: only at the end and on SIGTERM)")
    group.add_argument("--resume", action="store_true", help="continue from --save-dir's latest")
    group.add_argument("--overwrite", action="store_true",
                       help="delete the saved states in --save-dir and replace --log-file, from an "
                            "earlier run (without it such a run is refused)")


def add_export_flags(parser):
    group = parser.add_argument_group("export")
    group.add_argument("--export-hf", default=None, metavar="DIR",
                       help="at the end, write a Hugging Face folder that transformers loads")
    group.add_argument("--overwrite-export", action="store_true",
                       help="let --export-hf replace a folder that is not empty")


# Every group, in --help's order: train.py reads them all; eval.py and plan.py some of them.
FLAG_GROUPS = (add_model_flags, add_rotary_flags, add_step_flags, add_accumulation_flags,
               add_process_flags, add_data_flags, add_document_flags, add_technique_flags,
               add_training_flags, add_saved_state_flags, add_export_flags)


def stack_flag(text: str):
    """--stack's value: a level (checked in resolve_techniques) or auto."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a level 0-{MAX_STACK} or auto, got {text!r}")


def flags_parser(groups, **parser_options) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(**parser_options)
    for add_flags in groups:
        add_flags(parser)
    return parser


def config_from_flags(flags: argparse.Namespace, auto_on_gpu: bool = False,
                      reads_weights: bool = True) -> Config:
    """The Config of parsed flags, its techniques resolved; a field the command has no flag
    for keeps its default. auto_on_gpu (training): a GPU run given no technique flag takes
    --stack auto, the planner's fastest configuration that fits. reads_weights: the command
    loads --init-from's weights (the planner reads its config.json alone), so a damaged file
    is named now, not after --overwrite cleared the outputs."""
    if flags.init_from and flags.model is not None:
        raise ValueError(f"--model {flags.model} and --init-from: the --init-from folder's "
                         f"config.json names the model, --model would be ignored; drop --model")
    if getattr(flags, "steps", 1) < 1:  # code may build with steps=0 (benches); a command trains
        raise ValueError(f"--steps must be at least 1, got {flags.steps}")
    for flag in ("mlp_tile_tokens", "loss_tile_tokens"):
        if getattr(flags, flag, None) is not None and getattr(flags, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive whole number of "
                             f"tokens, got {getattr(flags, flag)}")
    cfg = Config(**{k: v for k, v in vars(flags).items() if k in Config.__dataclass_fields__
                    and k not in ("seq_len", "dtype", "model")})
    cfg.model = DEFAULTS.model if flags.model is None else flags.model
    cfg.seq_len = parse_tokens(flags.seq_len)
    cfg.dtype = flags.dtype or ("bfloat16" if cfg.device == "cuda" else "float32")
    if auto_on_gpu and cfg.device == "cuda" and not techniques_given(cfg):
        cfg.stack = AUTO
    cfg = resolve_techniques(cfg)
    if reads_weights and cfg.init_from:
        pretrained.check_weight_files(cfg.init_from)
    # A command's tile size without its tiles would be taken silently (code that builds a
    # Config may leave one set for levels without 04: it is not read there).
    if cfg.stack != AUTO and cfg.mlp_tile_tokens is not None and not (cfg.tile_mlp
                                                                       or cfg.tile_norm):
        raise ValueError("--mlp-tile-tokens is a setting of --tile-mlp (and --tile-norm) (04): "
                         "add one, --stack 4 or higher, or --stack auto (on GPUs: the planner "
                         "then tiles the MLP at that size)")
    if cfg.stack != AUTO and cfg.loss_tile_tokens is not None and not cfg.tile_loss:
        raise ValueError("--loss-tile-tokens is a setting of --tile-loss (04): add it, "
                         "--stack 4 or higher, or --stack auto (on GPUs)")
    if getattr(flags, "min_lr", None) is not None and cfg.lr_schedule == "constant":
        raise ValueError("--min-lr is where --lr-schedule cosine or linear ends; the schedule is "
                         "constant (the default), which would ignore it: add --lr-schedule "
                         "cosine (or linear), or drop --min-lr")
    return cfg


# ---------------------------------------------------------------------------------------------
# Which techniques the flags mean, and the combinations refused before any work starts
# ---------------------------------------------------------------------------------------------

def resolve_techniques(cfg: Config) -> Config:
    """Expand --stack, fill the defaults that follow the model (--lr, --min-lr) and refuse
    combinations that cannot work. Under --stack auto a setting given without its technique
    (--head-chunk without --untied, say) asks the planner for that technique instead."""
    auto = cfg.stack == AUTO
    if cfg.ulysses and cfg.untied:
        raise ValueError("--ulysses and --untied are alternatives for the same seam; pick one")
    if cfg.stack is not None and not auto:
        if not 0 <= cfg.stack <= MAX_STACK:
            raise ValueError(f"--stack must be between 0 and {MAX_STACK}, got {cfg.stack}")
        if cfg.ulysses and cfg.stack >= UNTIED_LEVEL:
            raise ValueError(f"--stack {cfg.stack} runs 05's Untied Ulysses in 02's place, and "
                             f"--ulysses asks for 02: drop --ulysses, or give --stack "
                             f"{UNTIED_LEVEL - 1} (the same techniques with 02's Ulysses)")
        for flag, level in TECHNIQUES:
            if level <= cfg.stack:
                setattr(cfg, flag, True)
        if cfg.untied:
            cfg.ulysses = False  # 05 replaces 02 at the same seam
    if cfg.offload:
        cfg.checkpoint = True  # offload moves the checkpoints, so it implies checkpointing
    if cfg.checkpoint_layers is not None and not cfg.checkpoint and not auto:
        raise ValueError("--checkpoint-layers is a setting of --checkpoint (03): add --checkpoint, "
                         "--offload or --stack 3 or higher")
    if cfg.checkpoint_layers is not None and cfg.checkpoint_layers < 1:
        raise ValueError(f"--checkpoint-layers must be at least 1 (without checkpointing, leave "
                         f"out --checkpoint), got {cfg.checkpoint_layers}")
    if cfg.keep_attention and not cfg.checkpoint and not auto:
        raise ValueError("--keep-attention is a setting of --checkpoint (03): add --checkpoint, "
                         "--offload or --stack 3 or higher")
    if cfg.doc_sep is not None:
        cfg.documents = True
    if cfg.head_chunk is not None and not cfg.untied and not auto:
        raise ValueError("--head-chunk is a setting of --untied (05)")
    if cfg.offload_model_state and not cfg.fsdp and not auto:
        raise ValueError("--offload-model-state is a setting of --fsdp (01): add --fsdp or "
                         "--stack 1 or higher")
    if cfg.overlap_optimizer and cfg.offload_model_state:
        raise ValueError("--overlap-optimizer (08) hides AdamW's pass over the GPU's memory "
                         "behind the forward; with --offload-model-state (01) AdamW runs on the "
                         "host's cores instead: drop one of them")
    if cfg.offload_moments and cfg.overlap_optimizer is False:
        raise ValueError("--offload-moments (09) streams the moments for 08's updates behind the "
                         "forward; --no-overlap-optimizer turns 08 off: drop one of them")
    if cfg.offload_moments and cfg.offload_model_state:
        raise ValueError("--offload-moments (09) keeps the moments on the host for AdamW on the "
                         "GPU; --offload-model-state (01) keeps all the model state there for "
                         "AdamW on the host's cores: drop one of them")
    if cfg.offload_moments:
        cfg.overlap_optimizer = True  # 09 streams for 08's updates, so it implies 08
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here")
    for flag, value, least in (("--steps", cfg.steps, 0), ("--batch-size", cfg.batch_size, 1),
                               ("--grad-accum", cfg.grad_accum, 1),
                               ("--warmup-steps", cfg.warmup_steps, 0)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if cfg.sp is not None and cfg.sp < 1:  # 0 would silently mean "all ranks"
        raise ValueError(f"--sp must be at least 1, got {cfg.sp}")
    if cfg.ring is not None and cfg.ring < 1:  # 0 would silently mean "picked"
        raise ValueError(f"--ring must be at least 1, got {cfg.ring}")
    if cfg.ring is not None and not (cfg.ulysses or cfg.untied or auto):
        raise ValueError("--ring is a setting of --ulysses or --untied (02/05): add one, or "
                         "--stack 2 or higher")
    if cfg.seq_len is not None and cfg.seq_len * cfg.batch_size > MAX_TOKENS:
        raise ValueError(f"--seq-len {cfg.seq_len} x --batch-size {cfg.batch_size} is more than "
                         f"{MAX_TOKENS:,} tokens (2^31: positions are 32-bit in the kernels)")
    if cfg.seq_len is not None and cfg.seq_len * cfg.batch_size * cfg.grad_accum > MAX_TOKENS:
        raise ValueError(f"--seq-len {cfg.seq_len} x --batch-size {cfg.batch_size} x --grad-accum "
                         f"{cfg.grad_accum} is more than {MAX_TOKENS:,} tokens a step (2^31: a "
                         f"step's micro-batches are read as one window)")
    if cfg.steps > MAX_STEPS:
        raise ValueError(f"--steps must be at most {MAX_STEPS:,}, got {cfg.steps}")
    if not 0 <= cfg.seed < 2**32:  # (the data's and the weights' generators derive seeds from
        # it, seed x 1,000,003 + an index, which must stay a 64-bit seed)
        raise ValueError(f"--seed must be a whole number from 0 to 2^32 - 1, got {cfg.seed}")
    if cfg.rope_theta is not None and not (math.isfinite(cfg.rope_theta) and cfg.rope_theta > 0):
        raise ValueError(f"--rope-theta must be a finite number > 0 (the rotary base), got "
                         f"{cfg.rope_theta}")
    if cfg.rope_original_context is not None and cfg.rope_original_context < 1:
        raise ValueError(f"--rope-original-context must be at least 1 token, got "
                         f"{cfg.rope_original_context}")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, "
                         f"got {cfg.lr_schedule!r}")
    if cfg.rope_factor is not None and not (math.isfinite(cfg.rope_factor)
                                            and cfg.rope_factor >= 1):
        raise ValueError(f"--rope-factor must be a finite number >= 1 (llama3 and yarn stretch the "
                         f"pretrained context by it), got {cfg.rope_factor}")
    args = model_args(cfg)  # an unknown preset or an unsupported Hugging Face config: a clear
    # error now
    n_layers = args.n_layers
    stretch = [flag for flag, value in (("--rope-factor", cfg.rope_factor),
                                        ("--rope-original-context", cfg.rope_original_context))
               if value is not None]
    if stretch and args.rope_scaling == "none":  # read by llama3's and yarn's scaling alone
        raise ValueError(f"{' and '.join(stretch)}: settings of --rope-scaling llama3 or yarn, "
                         f"and this model's rotary scaling is none (it would be ignored): add "
                         f"--rope-scaling llama3 (or yarn), or drop {' and '.join(stretch)}")
    if cfg.checkpoint_layers is not None and cfg.checkpoint_layers > n_layers:
        raise ValueError(f"--checkpoint-layers {cfg.checkpoint_layers} is more than the model's "
                         f"{n_layers} layers")
    check_offloaded_activations(cfg, n_layers, planned=auto or cfg.device == "cuda")
    if cfg.lr is None:
        cfg.lr = default_lr(cfg)
    if cfg.min_lr is None:
        cfg.min_lr = MIN_LR_FRACTION * cfg.lr
    for flag, value in (("--lr", cfg.lr), ("--min-lr", cfg.min_lr),
                        ("--weight-decay", cfg.weight_decay), ("--grad-clip", cfg.grad_clip)):
        if not (math.isfinite(value) and value >= 0):  # a negative clip would silently mean off
            raise ValueError(f"{flag} must be a finite number >= 0, got {value}"
                             + (" (0 turns clipping off)" if flag == "--grad-clip" else ""))
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"--min-lr ({cfg.min_lr:g}) must be at most --lr ({cfg.lr:g}): the "
                         f"schedule decays from --lr to --min-lr")
    if cfg.resume and not cfg.save_dir:
        raise ValueError("--resume needs --save-dir (where the checkpoints are)")
    if cfg.resume and cfg.overwrite:
        raise ValueError("--resume continues the checkpoints that --overwrite deletes; pick one")
    if cfg.save_every < 0:
        raise ValueError("--save-every must be >= 0")
    if cfg.export_hf:
        pretrained.check_export_dir(cfg.export_hf, cfg.overwrite_export)
    return cfg


def check_offloaded_activations(cfg: Config, n_layers: int, planned: bool) -> None:
    """07's blocks alternate with kept ones above 03's checkpointed ones: --offload-activations
    N needs 2N of the L blocks left unchecked (on a GPU the plan picks --checkpoint-layers
    K <= L - 2N)."""
    offloaded = cfg.offload_activations
    if offloaded < 0:
        raise ValueError(f"--offload-activations must be at least 0, got {offloaded}")
    if not offloaded:
        return
    most = (n_layers - bool(cfg.checkpoint)) // 2  # 03 checkpoints at least one block
    if offloaded > most:
        raise ValueError(f"--offload-activations {offloaded}: each offloaded block needs a kept "
                         f"block above it" + (" and 03 checkpoints at least one below"
                                               if cfg.checkpoint else "")
                         + f", so the model's {n_layers} layers allow at most {most} "
                         f"(a deeper --model allows more)")
    checkpointed = cfg.checkpoint_layers if cfg.checkpoint else 0
    if checkpointed is None and not planned:
        raise ValueError(f"--offload-activations {offloaded} needs blocks that 03 leaves "
                         f"unchecked: add --checkpoint-layers K with K + 2 x {offloaded} <= the "
                         f"model's {n_layers} layers")
    below = (checkpointed or 1) if cfg.checkpoint else 0  # (planned: at least one)
    if below + 2 * offloaded > n_layers:
        raise ValueError(f"--offload-activations {offloaded}: each offloaded block needs a kept "
                         f"block above it, so {2 * offloaded} blocks"
                         + (f" above --checkpoint-layers {checkpointed}" if checkpointed
                            else " above 03's checkpointed ones" if cfg.checkpoint else "")
                         + f"; the model has {n_layers} layers")


def techniques_given(cfg: Config) -> bool:
    """Whether any flag that chooses a technique or its setting was given (TECHNIQUE_FIELDS)."""
    def given(field, value):  # --stack 0 is a level given (0 == False would hide it)
        return value is not None and value is not False and (field == "stack" or value != 0)

    return any(given(field, getattr(cfg, field)) for field in TECHNIQUE_FIELDS)


def default_lr(cfg: Config) -> float:
    """--lr when it is not given: by the model's size (DEFAULT_LRS), or INIT_FROM_LR when
    training starts from pretrained weights."""
    if cfg.init_from:
        return INIT_FROM_LR
    n_params = num_params(model_args(cfg))
    return next(lr for limit, lr in DEFAULT_LRS if n_params < limit)


def learning_rate(cfg: Config, step: int) -> float:
    """The learning rate of `step`: a linear warmup to --lr over --warmup-steps, then
    --lr-schedule: constant, or a cosine or linear decay from --lr that reaches --min-lr at
    --steps. A function of the step alone, so resuming needs no state."""
    peak = cfg.lr if cfg.lr is not None else default_lr(cfg)  # a Config made in code
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * ((step + 1) / cfg.warmup_steps)
    if cfg.lr_schedule == "constant":
        return peak
    low = cfg.min_lr if cfg.min_lr is not None else MIN_LR_FRACTION * peak
    fraction = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    shape = (0.5 * (1 + math.cos(math.pi * fraction)) if cfg.lr_schedule == "cosine"
             else 1 - fraction)
    return low + (peak - low) * shape


def checkpointed_layers(cfg: Config, n_layers: int) -> int:
    """The blocks 03 checkpoints (and its recompute runs again): the first --checkpoint-layers,
    all of them by default, none without --checkpoint."""
    return (cfg.checkpoint_layers or n_layers) if cfg.checkpoint else 0


def model_args(cfg: Config) -> ModelArgs:
    """The model's shape: --init-from's config.json, else the --model preset; with the rotary
    settings of the --rope-* flags (context extension changes these, not the weights)."""
    args = (pretrained.model_args_from_hf(cfg.init_from) if cfg.init_from
            else get_model_args(cfg.model))
    rope = {"rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "rope_factor": cfg.rope_factor, "rope_original_context": cfg.rope_original_context}
    return replace(args, **{k: v for k, v in rope.items() if v is not None})


def model_name(cfg: Config) -> str:
    """What the logs call the model: the --init-from folder, else the --model preset."""
    return f"{cfg.init_from} (Hugging Face folder)" if cfg.init_from else cfg.model


def techniques_text(cfg: Config, head_chunk, ring: int = 1) -> str:
    names = [f for f, _ in TECHNIQUES if getattr(cfg, f)]
    names += [f"ring (R={ring})"] if ring > 1 else []
    names += ["tile_norm"] if cfg.tile_norm else []
    names += ["keep_attention"] if cfg.keep_attention else []
    names += ["offload_model_state"] if cfg.offload_model_state else []
    names += ["overlap_optimizer"] if cfg.overlap_optimizer else []
    names += ["offload_moments"] if cfg.offload_moments else []
    names += ([f"offload_activations ({cfg.offload_activations} blocks)"]
              if cfg.offload_activations else [])
    labels = {"untied": f"untied (U={head_chunk})"}
    n_layers = model_args(cfg).n_layers if cfg.checkpoint_layers else None
    if cfg.checkpoint_layers and cfg.checkpoint_layers < n_layers:  # --checkpoint-layers K < L
        labels["checkpoint"] = f"checkpoint (first {cfg.checkpoint_layers} of {n_layers} layers)"
    return ", ".join(labels.get(f, f) for f in names) or "none"
