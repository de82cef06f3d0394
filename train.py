"""train.py - compose the techniques of 01..06 and train.

    python train.py                                   # tiny model, synthetic data, CPU or GPU
    torchrun --nproc-per-node 8 train.py --model llama3-8b --seq-len 3M --stack 5
    python train.py --plan --model llama3-8b --seq-len 3M --stack 5   # its memory plan (plan.py)

The recipe, top-down: the flags make a Config (support/config.py), the Config a runtime of
data-parallel x sequence-parallel ranks (support/runtime.py), the runtime a model with the
techniques applied, then steps in a loop. `--stack N` turns on everything up to file N (0 =
plain training); each technique also has its own switch. They are applied to the model in this
order, on the meta device, before any weight is allocated:
  attention seam (02 Ulysses or 05 Untied Ulysses; with --ring, 06's ring inside either)
  -> tiling (04) -> checkpointing/offload (03) -> FSDP (01: each block, then the root)
which is the order torchtitan uses (checkpoint inside, FSDP outside).
"""

import contextlib
import importlib
import io
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

import model as llama
import plan
from support import build, config, keep_attention, kernels, pretrained, progress, saved_state
# Scripts that run the recipe step by step (tests, bench/) take it all from here: train.Config,
# train.resolve_techniques, train.setup_runtime, train.build_model, train.train_step.
from support.config import (Config, model_args, model_name, resolve_techniques,  # noqa: F401
                            techniques_text)
from support.data import Documents, TokenData
from support.runtime import Runtime, setup_runtime

# The numbered files start with a digit, so they are imported by name.
ulysses = importlib.import_module("02_ulysses")
checkpointing = importlib.import_module("03_checkpoint_offload")
tiling = importlib.import_module("04_alst_tiling")
untied = importlib.import_module("05_untied_ulysses")
ring_attention = importlib.import_module("06_ring_attention")


@dataclass
class Run:
    history: list
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def train(cfg: Config) -> Run:
    """The recipe: runtime, the checks that need it, the model, the loop."""
    rt = setup_runtime(cfg)
    saved_state.check_outputs(cfg)  # every output path, before anything is written
    args = model_args(cfg)
    # A step's micro-batches (--grad-accum) are the rows of one --batch-size x N window, so the
    # data position stays the step: resuming needs no state.
    data = TokenData(replace(cfg, batch_size=cfg.batch_size * cfg.grad_accum), args.vocab_size,
                     rt.dp_rank, rt.dp, eos_id=args.eos_id)
    # Before claiming the outputs: --overwrite deletes an earlier run's saved states and log
    # there, which a run refused for its host memory must not have done.
    cfg.head_chunk = choose_head_chunk(cfg, rt)
    cfg.keep_attention = choose_keep_attention(cfg, rt)
    check_host_memory(cfg, rt)
    with saved_state.claim_outputs(cfg, rt) as log_file, saved_state.stop_signals(rt.rank) as stop:
        return train_loop(cfg, rt, args, data, log_file, stop)


# The model: the techniques in their composition order, then FSDP; and its optimizer.

def build_model(cfg: Config, rt: Runtime):
    """The model of `cfg` with its techniques applied, sharded and on the device; with
    --init-from its weights are read from the folder, each rank only its shard."""
    args = model_args(cfg)
    dtype = getattr(torch, cfg.dtype)

    def apply_techniques(model):  # the composition order: seam (02/05, 06) -> 04 -> 03; then 01
        if rt.ring > 1:  # Ulysses over P/R ranks around a ring over R (06), for 02 or 05
            ring_attention.apply_ring(model, rt.ulysses_group, rt.ring_group, cfg.untied,
                                      cfg.head_chunk)
        elif cfg.ulysses:
            ulysses.apply_ulysses(model, rt.sp_group)
        elif cfg.untied:
            untied.apply_untied_ulysses(model, rt.sp_group, cfg.head_chunk)
        if cfg.tile_mlp or cfg.tile_loss or cfg.tile_norm:
            tiling.apply_tiling(model, tile_mlp=cfg.tile_mlp, tile_loss=cfg.tile_loss,
                                mlp_tile_tokens=cfg.mlp_tile_tokens,
                                loss_tile_tokens=cfg.loss_tile_tokens, tile_norm=cfg.tile_norm)
        if cfg.checkpoint:
            keep_attention.apply_keep_attention(model, cfg.keep_attention)  # before: 03 wraps it
            checkpointing.apply_checkpointing(model, offload=cfg.offload)

    mesh = rt.fsdp_mesh if cfg.fsdp else None  # 01's apply_fsdp shards over it (support/build.py)
    if cfg.init_from:
        return pretrained.build_from_hf(cfg.init_from, rt.device, mesh, dtype,
                                        before_sharding=apply_techniques, args=args,
                                        offload_model_state=cfg.offload_model_state)[0]
    # Draw weights whole on the CPU (identical to the unsharded model) while that is cheap;
    # the big presets draw each rank's shard on its device.
    exact = llama.num_params(args) < 2e8
    return build.build_model(args, rt.device, mesh, dtype, seed=cfg.seed, exact_init=exact,
                             before_sharding=apply_techniques,
                             offload_model_state=cfg.offload_model_state)


def make_optimizer(model, cfg: Config):
    """AdamW. State on the GPU: foreach=False, one parameter at a time (bounded temporaries);
    state on the host (--offload-model-state, 01): the fused CPU AdamW, with the rank's cores."""
    adamw = dict(lr=learning_rate(cfg, 0), weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if cfg.offload_model_state:
        return host_optimizer(model.parameters(), **adamw)
    return torch.optim.AdamW(model.parameters(), foreach=False, **adamw)


def host_optimizer(params, **adamw) -> torch.optim.Optimizer:
    """AdamW for parameters held in host memory: the fused CPU kernel (one pass over each
    tensor, no temporaries; 3.6x faster than foreach on one thread), else foreach. torchrun
    sets OMP_NUM_THREADS=1 per process, so each rank first takes its share of the host's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    ranks_here = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))
    share = max(1, cores // int(ranks_here))
    torch.set_num_threads(max(share, torch.get_num_threads()))
    params = list(params)
    try:
        return torch.optim.AdamW(params, fused=True, **adamw)
    except (RuntimeError, TypeError):  # a torch without the fused CPU path for these params
        return torch.optim.AdamW(params, foreach=True, **adamw)


# One step.

def forward_backward(model, tokens: torch.Tensor, rt: Runtime, labels=None,
                     documents=None, micro_batches: int = 1) -> torch.Tensor:
    """Loss (global token mean, detached) after backward on this rank's part of `tokens`
    (B, S + 1): 02's sharded step, with an out-of-memory error naming its phase. documents:
    the packed documents of `tokens` (data.Documents), None for one document per row.

    micro_batches > 1 (--grad-accum): the rows in that many micro-batches, one forward and
    backward each, whose gradients add up to the whole batch's: the labels of all of them (and
    of every rank) are counted first, and each divides its summed loss by that one count. FSDP
    reduce-scatters each micro-batch's gradients as its backward goes, into the sharded ones:
    no unsharded gradient waits between micro-batches (deferring the reduction would keep a
    whole model's gradients per GPU through the next forward, the memory long sequences need)."""
    world_group = dist.group.WORLD if rt.world > 1 else None
    tokens = tokens.to(rt.device)
    labels = None if labels is None else labels.to(rt.device)
    order = rt.token_order(tokens.shape[1] - 1)  # 06's zigzag with a ring, else None
    if micro_batches == 1:
        return ulysses.loss_and_backward(model, tokens, rt.sp_rank, rt.sp, world_group, labels,
                                         phase=out_of_memory_names, documents=documents,
                                         order=order)
    if tokens.shape[0] % micro_batches:
        raise ValueError(f"{tokens.shape[0]} rows do not split into {micro_batches} micro-batches")
    every_label = documents.labels.to(rt.device) if documents is not None else labels
    local_labels = ulysses.shard_sequence(tokens, rt.sp_rank, rt.sp, every_label, order=order)[1]
    n_tokens = ulysses.global_token_count(local_labels, world_group)
    rows = tokens.shape[0] // micro_batches
    loss = 0
    for first in range(0, tokens.shape[0], rows):
        part = slice(first, first + rows)
        loss += ulysses.loss_and_backward(
            model, tokens[part], rt.sp_rank, rt.sp, world_group,
            None if labels is None else labels[part], phase=out_of_memory_names,
            documents=None if documents is None else rows_of(documents, part), n_tokens=n_tokens,
            order=order)
    return loss


def rows_of(documents: Documents, rows: slice) -> Documents:
    """The packed documents of some rows of a batch: each row starts a document, so the
    boundaries inside them, shifted to the first row, are theirs."""
    seq_len = documents.labels.shape[1]
    first, last = rows.start * seq_len, rows.stop * seq_len
    return Documents(documents.labels[rows], documents.position_ids[rows],
                     tuple(b - first for b in documents.cu_seqlens if first <= b <= last))


def learning_rate(cfg: Config, step: int) -> float:
    """The learning rate of `step`: a linear warmup to --lr over --warmup-steps, then
    --lr-schedule: constant, or a cosine or linear decay from --lr that reaches --min-lr at
    --steps. A function of the step alone, so resuming needs no state."""
    peak = cfg.lr if cfg.lr is not None else config.default_lr(cfg)  # a Config made in code
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak * ((step + 1) / cfg.warmup_steps)
    if cfg.lr_schedule == "constant":
        return peak
    low = cfg.min_lr if cfg.min_lr is not None else config.MIN_LR_FRACTION * peak
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return low + (peak - low) * shape


def train_step(model, optimizer, tokens, rt: Runtime, cfg: Config, labels=None, step: int = 0,
               documents=None) -> dict:
    """One optimizer step on `tokens`: cfg.grad_accum micro-batches of its rows. A non-finite
    loss or gradient raises before the weights change."""
    lr = learning_rate(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = float(forward_backward(model, tokens, rt, labels, documents, cfg.grad_accum))
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
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr}


# The loop: steps, the log, saved state, a stop by signal, the export.

def train_loop(cfg: Config, rt: Runtime, args, data: TokenData, log_file, stop: dict) -> Run:
    if rt.ring > 1 and rt.rank == 0:
        print(f"Ulysses x ring: {rt.ulysses} x {rt.ring} (06)" + ("; --ring picked: the heads do "
              "not split over all P ranks" if cfg.ring is None else ""))
    if cfg.untied and rt.rank == 0:
        stages = args.n_heads // (cfg.head_chunk or rt.ulysses)
        print(f"Untied Ulysses: {stages} stage{'s' if stages > 1 else ''} of "
              f"U = {cfg.head_chunk or rt.ulysses} query heads")
    model = build_model(cfg, rt)
    optimizer = make_optimizer(model, cfg)
    first_step = saved_state.load_state(cfg, rt, model, optimizer) if cfg.resume else 0
    is_main = rt.rank == 0
    header = {"config": asdict(cfg), "world_size": rt.world, "dp": rt.dp, "sp": rt.sp, "ring": rt.ring,
              "torch": torch.__version__,
              "attention_kernel": attention_kernel(cfg, rt, args),
              "parameters": llama.num_params(args), "first_step": first_step}
    if is_main:
        print(f"{model_name(cfg)}: {header['parameters'] / 1e6:.1f}M params, {cfg.seq_len:,} tokens"
              + (f" x {cfg.grad_accum} micro-batches" if cfg.grad_accum > 1 else "")
              + f", world {rt.world} (dp {rt.dp} x sp {rt.sp}), {cfg.dtype} on {cfg.device}, "
              f"{schedule_text(cfg)}, attention: {header['attention_kernel']}, techniques: "
              f"{techniques_text(cfg, cfg.head_chunk or rt.ulysses, rt.ring)}"
              + ((", packed documents (" + (f"separator {data.separator}" if data.separator is not None
                                             else "boundary index") + ")") if cfg.documents else "")
              + (f", resumed at step {first_step}" if cfg.resume else ""))
        if data.documents_ignored:
            print(f"note: {cfg.data} lists its documents (sidecar or .docs index), but without "
                  f"--documents each window trains as one sequence: documents attend to each other")
    if log_file:
        log_file.write(json.dumps(header) + "\n")
    history, last_saved, run_start = [], None, time.perf_counter()
    tokens_per_gpu = cfg.batch_size * cfg.grad_accum * cfg.seq_len * rt.dp / rt.world
    # Bars only on a terminal: written into a log file they would garble the step lines.
    show_bar = progress.on_a_terminal(is_main)
    per = "gpu" if rt.device.type == "cuda" else "rank"

    def summary():
        return progress.summary_line(history, tokens_per_gpu, time.perf_counter() - run_start, per,
                                     last_saved, saved_state.resume_command(sys.argv))

    with progress.layer_bars(model, cfg.grad_accum, show_bar) as start_bar:
        for step in tqdm(range(first_step, cfg.steps), disable=not show_bar, desc="train", leave=False):
            tokens = data.batch(step)  # the data position is the step: resuming needs nothing more
            documents = data.documents(step, tokens)  # None unless --documents
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.synchronize()
            start_bar(step)
            start = time.perf_counter()
            try:
                metrics = train_step(model, optimizer, tokens, rt, cfg, step=step, documents=documents)
            except StepOutOfMemory as error:
                raise StepOutOfMemory(plan.out_of_memory_report(error, cfg, rt)) from error
            if rt.device.type == "cuda":
                torch.cuda.synchronize()
            record = step_record(step, metrics, time.perf_counter() - start, tokens_per_gpu,
                                 documents, rt)
            history.append(record)
            if is_main:
                tqdm.write(step_text(record, per))
                if log_file:
                    log_file.write(json.dumps(record) + "\n")
                    log_file.flush()
            stopping = saved_state.any_rank("signal" in stop, rt)  # every rank stops after the same step
            done = step + 1
            if cfg.save_dir and (stopping or done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0)):
                path = last_saved = saved_state.save_state(cfg, rt, model, optimizer, done)
                if is_main:
                    tqdm.write(f"saved {path}")
            if stopping:
                why = f"stopped by {stop.get('signal', 'a signal to another rank')} after step {step}"
                if not cfg.save_dir:  # nothing to continue from: not a success
                    raise saved_state.StopRequested(f"{why}: no checkpoint written (no --save-dir)")
                if is_main:
                    print(f"{why}: checkpoint {path}; resume with:\n  "
                          f"{saved_state.resume_command(sys.argv)}", flush=True)
                    print(summary(), flush=True)
                return Run(history, model, optimizer)  # no export: the run is not finished
    if cfg.export_hf:  # every rank: the export gathers each tensor from its shards
        # fp32 runs export fp32 (exact); GPU runs bf16, as published checkpoints are.
        pretrained.export_hf(model, args, cfg.export_hf, overwrite=cfg.overwrite_export,
                             dtype=getattr(torch, cfg.dtype), source_dir=cfg.init_from,
                             data_path=None if cfg.data == "synthetic" else cfg.data,
                             max_position_embeddings=max(cfg.seq_len, args.rope_original_context))
        if is_main:
            print(f"exported {cfg.export_hf} (transformers: AutoModelForCausalLM.from_pretrained)")
    if is_main:
        print(summary(), flush=True)
    return Run(history, model, optimizer)


def step_record(step: int, metrics: dict, step_time: float, tokens_per_gpu: float, documents,
                rt: Runtime) -> dict:
    """A step's line of the log: its metrics (loss, grad_norm, lr), time, throughput, memory."""
    return {"step": step, **metrics, "step_time_s": round(step_time, 4),
            **({"documents": documents.count} if documents is not None else {}),
            "tokens_per_s_per_gpu": round(tokens_per_gpu / step_time, 1),
            "peak_gpu_mem_gib": (round(torch.cuda.max_memory_allocated() / 2**30, 3)
                                 if rt.device.type == "cuda" else None)}


def step_text(record: dict, per: str) -> str:
    mem = f" | peak {record['peak_gpu_mem_gib']:.2f} GiB" if record["peak_gpu_mem_gib"] else ""
    return (f"step {record['step']:4d} | loss {record['loss']:.4f} | lr {record['lr']:.3g} | "
            f"{record['tokens_per_s_per_gpu']:,.0f} tok/s/{per} | {record['step_time_s']:.3f}s{mem}")


def schedule_text(cfg: Config) -> str:
    """The learning rate as the run's first line says it: peak, warmup, schedule."""
    default = cfg.lr == config.default_lr(cfg)
    return (f"lr {cfg.lr:g}" + (f" (--lr's default for {'--init-from' if cfg.init_from else 'this size'})"
                                if default else "")
            + (f" after {cfg.warmup_steps} warmup steps" if cfg.warmup_steps else "")
            + (f", {cfg.lr_schedule} to {cfg.min_lr:g} at step {cfg.steps}"
               if cfg.lr_schedule != "constant" else ""))


def attention_kernel(cfg: Config, rt: Runtime, args) -> str:
    """The kernel attention runs (for the log); 05, 06's ring and --keep-attention call its
    forward and backward separately."""
    name = kernels.attention_kernel_name(rt.device, getattr(torch, cfg.dtype), args.head_dim)
    users = [f for f, on in (("05", cfg.untied), ("06", rt.ring > 1), ("03", cfg.keep_attention)) if on]
    if users:
        name += f" (forward and backward with log-sum-exp, {', '.join(users)})"
    return name


# Decided before the model is built, with the planner: 05's head chunk, the host's memory.

def choose_head_chunk(cfg: Config, rt: Runtime, forward_only: bool = False) -> int | None:
    """Untied Ulysses' head chunk U for this run: --head-chunk, else on GPUs the fewest stages
    whose planned step (forward_only: evaluation's forward) fits the smallest GPU
    (plan.fewest_stages_that_fit), else U = P (least memory; 05's default). Every rank decides
    the same: the all-to-alls must match."""
    if not cfg.untied or cfg.head_chunk is not None or rt.device.type != "cuda":
        return cfg.head_chunk
    return plan.fewest_stages_that_fit(cfg, rt.world, plan.smallest_gpu_memory(rt), forward_only)


def choose_keep_attention(cfg: Config, rt: Runtime) -> bool:
    """--keep-attention / --no-keep-attention as given; else on for a GPU run that checkpoints
    when the plan says the GPU and the host take it (keep_attention_fits), said in a line; off on
    the CPU (no plan). Every rank decides the same, from the least memory any rank has."""
    if cfg.keep_attention is not None:
        return cfg.keep_attention
    if not cfg.checkpoint or rt.device.type != "cuda":
        return False
    gpu_mem, host_mem = plan.smallest_gpu_memory(rt), least_host_memory(rt)
    if not keep_attention_fits(cfg, rt.world, gpu_mem, host_mem, ranks_on_this_node()):
        return False
    if rt.rank == 0:
        print("--keep-attention: on, as the plan fits the GPU and the host with it (the recompute "
              "skips attention: ~1.2x faster steps at long lengths); --no-keep-attention turns it off")
    return True


def keep_attention_fits(cfg: Config, world: int, gpu_mem: int, host_mem: int | None,
                        local_ranks: int) -> bool:
    """Whether the plan with --keep-attention fits: on the GPU within its usable memory, adding
    nothing to the step's peak or fitting with the planner's margin (plan.fits_on_gpu, the one
    definition of "fits"); on the host, this node's ranks' planned bytes (the kept outputs
    double the offloaded checkpoints) within 90% of what is available (None: unknown, so no)."""
    if host_mem is None:
        return False
    usable = gpu_mem - plan.PLAN_GPU_RESERVE
    kept = plan.plan_memory(replace(cfg, keep_attention=True), world)
    plain = plan.plan_memory(replace(cfg, keep_attention=False), world)
    gpu_fits = kept["peak"] <= usable and (kept["peak"] <= plain["peak"]
                                           or plan.fits_on_gpu(kept["peak"], gpu_mem))
    return gpu_fits and kept["host"] * local_ranks <= 0.9 * host_mem


def check_host_memory(cfg: Config, rt: Runtime) -> None:
    """`host_memory_error` for a GPU run (pinned host buffers; on a CPU they are the activations'
    own memory), with the least memory any rank sees, so that every rank decides the same."""
    if rt.device.type != "cuda" or not (cfg.offload or cfg.offload_model_state):
        return
    available = least_host_memory(rt)
    if available is None:  # unknown somewhere: not refused
        return
    error = host_memory_error(cfg, rt.world, ranks_on_this_node(), available)
    if error:
        raise ValueError(error)


def least_host_memory(rt: Runtime) -> int | None:
    """The least available host memory any rank sees (None where one does not know it)."""
    available = torch.tensor([available_host_memory() or -1], device=rt.device)
    if dist.is_initialized():
        dist.all_reduce(available, op=dist.ReduceOp.MIN)
    return None if available.item() < 0 else int(available.item())


def ranks_on_this_node() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


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
    planned = plan.plan_memory(cfg, world)
    need = planned["host"] * local_ranks
    if need <= available:
        return None
    parts = ", ".join(f"{name} {nbytes / 2**30:.1f}" for name, nbytes in planned["host_parts"].items() if nbytes)
    return (f"the host memory planned for this node's {local_ranks} rank{'s' if local_ranks > 1 else ''}, "
            f"{need / 2**30:.1f} GiB "
            f"({parts} GiB per rank), is more than the {available / 2**30:.1f} GiB available"
            + ("; --keep-attention doubles the offloaded checkpoints: drop it" if cfg.keep_attention else "")
            + "; or use more GPUs or a shorter --seq-len (python plan.py with the same flags shows the plan)")


# The command line, and failing clearly: out of memory names its phase and what to turn on next.

FLAG_GROUPS = (config.add_model_flags, config.add_rotary_flags, config.add_step_flags,
               config.add_accumulation_flags, config.add_process_flags, config.add_data_flags, config.add_document_flags,
               config.add_technique_flags, config.add_training_flags,
               config.add_saved_state_flags, config.add_export_flags)


def parse_args(argv=None) -> Config:
    parser = config.flags_parser(
        FLAG_GROUPS, description="Train a Llama on long sequences with 01..06.",
        epilog="the memory a run needs, without a GPU: python plan.py --help")
    with quiet_unless_first_rank():  # argparse's own errors and --help: once under torchrun
        flags, unknown = parser.parse_known_args(argv)
        if unknown:  # the planner's --gpus, say
            parser.error(f"unrecognized arguments: {' '.join(unknown)} (the memory planner's flags "
                         f"go with --plan: python train.py --plan ..., or python plan.py --help)")
    return config.config_from_flags(flags)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--plan" in argv:  # this run's memory plan: plan.py, given the flags it reads
        return plan.main(planner_argv(argv))
    exit_on_error(lambda: train(parse_args(argv)))


def planner_argv(argv: list) -> list:
    """argv without --plan and the flags that only training reads (--lr, --save-dir, ...); at
    training's --seq-len unless it gives one (plan.py's own default is max)."""
    training_only = [group for group in FLAG_GROUPS if group not in plan.FLAG_GROUPS]
    parser = config.flags_parser(training_only, add_help=False, allow_abbrev=False)
    return ["--seq-len", str(config.DEFAULTS.seq_len)] + [
        arg for arg in parser.parse_known_args(argv)[1] if arg != "--plan"]


def exit_on_error(run) -> None:
    """run(); a failure we explain (bad input, a non-finite step, out of memory, a stop) ends
    the process with `error: ...` and exit code 1, no traceback. The process group goes either way.

    Under torchrun, an error that every rank meets alike (bad flags, a missing file, what the
    ranks decide together) is printed once, by the first rank of each node (a node's torchrun
    prints one log); the others wait a moment before they exit, as torchrun stops the remaining
    workers as soon as one ends. A rank's own error (out of memory) is printed by that rank, with
    its rank."""
    try:
        run()
    except (ValueError, FloatingPointError, StepOutOfMemory, saved_state.StopRequested,
            saved_state.SaveFailed, pretrained.ExportFailed) as error:
        if isinstance(error, StepOutOfMemory) and int(os.environ.get("WORLD_SIZE", 1)) > 1:
            print(f"[rank {os.environ.get('RANK', '?')}] error: {error}", file=sys.stderr, flush=True)
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


if __name__ == "__main__":
    main()
