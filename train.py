"""train.py - compose the techniques of 01..09 and train.

    python train.py                                   # tiny model, synthetic data, CPU or GPU
    torchrun --nproc-per-node 8 train.py --model llama3-8b --seq-len 3M   # --stack auto on GPUs
    python train.py --plan --model llama3-8b --seq-len 3M --stack 5   # its memory plan (plan.py)

The recipe, top-down: the flags make a Config (support/config.py), on GPUs the planner fills
what they leave open (plan.py), the Config makes a runtime of data-parallel x sequence-parallel
ranks (support/runtime.py), the runtime a model with the techniques applied, then steps in a
loop. `--stack N` turns on the techniques of files 1..N up to 5 (0 = plain training; at 5, 05
takes 02's place; 06's ring, 07, 08, 09 and 04's norm tiles have their own flags), `--stack
auto` the planner's fastest that fits (a GPU run's default); each technique also has its own
switch.
They are applied in this order, on the meta device, before any weight:
  --keep-attention's kernel (support/keep_attention.py, a speed setting of 03)
  -> attention seam (02 Ulysses or 05 Untied Ulysses; with --ring, 06's ring inside either)
  -> tiling (04) -> checkpointing/offload (03) -> the activations of blocks above 03's (07)
  -> FSDP (01: each block, then the root; --offload-model-state keeps the shards on the host)
which is the order torchtitan uses (checkpoint inside, FSDP outside). Then the optimizer: fused
AdamW, or with --overlap-optimizer 08's, each block's update behind its next forward (with
--offload-moments 09's: the blocks' moments streamed in from the host for it).
"""

import math
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from model import num_params
from support import build, config, errors, keep_attention, progress, saved_state
from support.config import Config, learning_rate, model_args
from support.data import TokenData
from support.errors import exit_on_error, out_of_memory_names
from support.host_memory import check_cpu_run_fits, use_this_ranks_cores
from support.lessons import (activation_offload, checkpointing, moments_offload,
                             optimizer_overlap, ring_sp, tiling, ulysses_sp, untied_sp)
from support.runtime import Runtime, read_machine, setup_runtime


# The command line: training's flags, or --plan's.

def parse_args(argv=None) -> Config:
    parser = config.flags_parser(
        config.FLAG_GROUPS, description="Train a Llama on long sequences with 01..09.",
        epilog="the memory a run needs, without a GPU: python train.py --plan <these flags>, "
               "or python plan.py --help")
    with errors.quiet_unless_first_rank():  # argparse's own errors and --help: once (torchrun)
        flags, unknown = parser.parse_known_args(argv)
        if unknown:  # the planner's --gpus, say
            parser.error(f"unrecognized arguments: {' '.join(unknown)} (the memory planner's flags "
                         f"go with --plan: python train.py --plan ..., or python plan.py --help)")
    return config.config_from_flags(flags, auto_on_gpu=True)


@dataclass
class Run:
    history: list
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def train(cfg: Config) -> Run:
    """The recipe: the plan's choices, the runtime, the model, the loop."""
    # On GPUs the planner makes every choice the flags leave open (--stack auto's techniques,
    # 05's U, 03's --keep-attention and checkpointed blocks, 04's MLP tile) and checks host
    # memory, before anything is claimed (--overwrite deletes an earlier run's outputs, a
    # refused one not). The CPU plans nothing (--stack auto there: the planner says why not).
    machine, plan_lines, expected = read_machine(cfg), [], None  # machine: None on the CPU
    if machine is not None or cfg.stack == config.AUTO:
        import plan  # only where a run plans

        choice = plan.plan_run(cfg, machine)
        cfg, plan_lines, expected = replace(cfg, **choice.settings), choice.lines, choice.expected
    rt = setup_runtime(cfg)
    # Nothing here draws random numbers in a step; seeded, one that does (a fork's dropout)
    # repeats, each rank its own stream, and a resumed run continues it (saved_state's RNG).
    torch.manual_seed(cfg.seed * 1_000_003 + rt.rank)
    saved_state.check_outputs(cfg)  # every output path, before anything is written
    args = model_args(cfg)
    if cfg.device == "cpu":  # nothing planned there: at least the model state must fit
        check_cpu_run_fits(config.model_name(cfg), num_params(args), cfg.fsdp, cfg.dtype)
    # A step's micro-batches (--grad-accum) are the rows of one --batch-size x N window, so the
    # data position stays the step: resuming needs no state.
    data = TokenData(replace(cfg, batch_size=cfg.batch_size * cfg.grad_accum), args.vocab_size,
                     rt.dp_rank, rt.dp, eos_id=args.eos_id)
    with saved_state.run_outputs(cfg, rt) as outputs:  # the log, saved states, a stop, the export
        if rt.rank == 0:  # what the plan chose; 06's and 05's layout
            for line in plan_lines + progress.layout_lines(cfg, rt, args.n_heads):
                print(line)
        model = build_model(cfg, rt)
        optimizer = make_optimizer(model, cfg)
        first_step = saved_state.load_state(cfg, rt, model, optimizer) if cfg.resume else 0
        return train_loop(cfg, rt, model, optimizer, data, first_step, outputs, expected)


# The model: the techniques in their composition order, then FSDP; and its optimizer.

def build_model(cfg: Config, rt: Runtime):
    """The model of `cfg` with its techniques applied, sharded and on the device; with
    --init-from its weights are read from the folder, each rank only its shard."""
    args = model_args(cfg)
    dtype = getattr(torch, cfg.dtype)

    def apply_techniques(model):  # the order: (keep-attention) -> seam (02/05, 06) -> 04 -> 03
        # -> 07; then 01
        if cfg.checkpoint:  # --keep-attention's kernel first: 02 wraps it, 03 its blocks
            keep_attention.apply_keep_attention(model, cfg.keep_attention)
        if rt.ring > 1:  # Ulysses over P/R ranks around a ring over R (06), for 02 or 05
            ring_sp.apply_ring(model, rt.ulysses_group, rt.ring_group, cfg.untied, cfg.head_chunk)
        elif cfg.ulysses:
            ulysses_sp.apply_ulysses(model, rt.sp_group)
        elif cfg.untied:
            untied_sp.apply_untied_ulysses(model, rt.sp_group, cfg.head_chunk)
        if cfg.tile_mlp or cfg.tile_loss or cfg.tile_norm:
            tiling.apply_tiling(model, tile_mlp=cfg.tile_mlp, tile_loss=cfg.tile_loss,
                                mlp_tile_tokens=cfg.mlp_tile_tokens,
                                loss_tile_tokens=cfg.loss_tile_tokens, tile_norm=cfg.tile_norm)
        if cfg.checkpoint:  # --keep-attention's offloader moves the kept outputs with the inputs
            offloader = (keep_attention.Offloader if cfg.keep_attention
                         else checkpointing.BlockInputOffloader)
            checkpointing.apply_checkpointing(model, cfg.offload, cfg.checkpoint_layers, offloader)
        if cfg.offload_activations:  # 07: the blocks above 03's keep theirs in host memory
            first = config.checkpointed_layers(cfg, args.n_layers)
            activation_offload.apply_activation_offload(model, cfg.offload_activations, first)

    mesh = rt.fsdp_mesh if cfg.fsdp else None  # 01's apply_fsdp shards over it (support/build.py)
    if cfg.init_from:
        return build.build_from_hf(cfg.init_from, rt.device, mesh, dtype,
                                   before_sharding=apply_techniques, args=args,
                                   offload_model_state=cfg.offload_model_state)[0]
    # Draw weights whole on the CPU (identical to the unsharded model) while that is cheap;
    # the big presets draw each rank's shard on its device.
    exact = num_params(args) < 2e8
    return build.build_model(args, rt.device, mesh, dtype, seed=cfg.seed, exact_init=exact,
                             before_sharding=apply_techniques,
                             offload_model_state=cfg.offload_model_state)


def make_optimizer(model, cfg: Config):
    """AdamW, fused: one pass over each parameter and its state, no temporaries, wherever the
    state lives (the GPU; the host with --offload-model-state, 01); with --overlap-optimizer
    08's, each block's update behind its next forward; with --offload-moments 09's."""
    if cfg.offload_model_state:
        use_this_ranks_cores()  # the host steps it
    settings = {"lr": learning_rate(cfg, 0), "weight_decay": cfg.weight_decay,
                "betas": config.ADAMW_BETAS}
    if cfg.offload_moments:  # 09: 08's, the blocks' moments streamed from the host
        return moments_offload.apply_moments_offload(model, **settings)
    if cfg.overlap_optimizer:  # 08: each block's update behind its next forward
        return optimizer_overlap.apply_optimizer_overlap(model, **settings)
    return torch.optim.AdamW(model.parameters(), fused=True, **settings)


# One step.

def forward_backward(model, tokens: torch.Tensor, rt: Runtime, labels=None, documents=None,
                     micro_batches: int = 1, phase=out_of_memory_names) -> torch.Tensor:
    """Loss (global token mean, detached) after backward on this rank's part of `tokens`
    (B, S + 1): 02's loss_and_backward (shift, shard, divide by the global count) with packed
    `documents` (data.Documents: their labels and positions; their global boundaries go to the
    model whole), 06's token order, and `phase(name)` naming an out-of-memory error's phase.

    micro_batches > 1 (--grad-accum): the rows in that many micro-batches, one forward and
    backward each, each dividing by the count of all of them: their gradients add up to the
    whole batch's. FSDP reduce-scatters each micro-batch's gradients as its backward goes: no
    unsharded gradient waits for the next forward (the memory long sequences need)."""
    if tokens.shape[0] % micro_batches:
        raise ValueError(f"{tokens.shape[0]} rows do not split into {micro_batches} micro-batches")
    tokens, positions = tokens.to(rt.device), None
    if documents is not None:
        if labels is not None:
            raise ValueError("pass labels or documents (which carry their labels), not both")
        labels, positions = documents.labels, documents.position_ids.to(rt.device)
    order = rt.token_order(tokens.shape[1] - 1)  # 06's zigzag with a ring, else None
    input_ids, labels, positions = ulysses_sp.shard_sequence(
        tokens, rt.sp_rank, rt.sp, None if labels is None else labels.to(rt.device), positions,
        order)
    world_group = dist.group.WORLD if rt.world > 1 else None
    n_tokens = ulysses_sp.global_token_count(labels, world_group)  # every micro-batch's
    rows, loss = tokens.shape[0] // micro_batches, 0
    for part in (slice(first, first + rows) for first in range(0, tokens.shape[0], rows)):
        bounds = None if documents is None else documents.rows(part).cu_seqlens
        with phase("forward"):
            part_loss = model(input_ids[part], positions[part], labels[part],
                              cu_seqlens=bounds) / n_tokens
        with phase("backward"):
            part_loss.backward()
        part_loss = part_loss.detach()
        if world_group is not None:
            dist.all_reduce(part_loss, group=world_group)  # every rank's share, added up
        loss += part_loss
    return loss


def train_step(model, optimizer, tokens, rt: Runtime, cfg: Config, labels=None, step: int = 0,
               documents=None) -> dict:
    """One optimizer step on `tokens`: cfg.grad_accum micro-batches of its rows. A non-finite
    loss or gradient norm updates nothing and raises."""
    lr = learning_rate(cfg, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = forward_backward(model, tokens, rt, labels, documents, cfg.grad_accum)
    grad_norm = clipped_step(model, optimizer, loss, cfg.grad_clip)
    loss, grad_norm = float(loss), float(grad_norm)  # the step's one wait for the GPU
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise FloatingPointError(f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at "
                                 f"step {step}; the weights were not updated")
    return {"loss": loss, "grad_norm": grad_norm, "lr": lr}


def clipped_step(model, optimizer, loss: torch.Tensor, max_norm: float) -> torch.Tensor:
    """AdamW's step with the gradients clipped to a global norm of `max_norm` (0: unclipped),
    skipped where the loss or the norm is not finite; returns the norm (a tensor, not waited
    for). The clip is clip_grad_norm_'s (g x max_norm / (norm + 1e-6) where that is below 1),
    applied in fused AdamW's own pass: the norm reads the gradients once, and AdamW divides
    each by `grad_scale` as it reads it and skips the whole step, its state included, where
    `found_inf` is set. No pass of the scaling's own, and on the GPU no wait before the step
    (with the state on the host, copying the loss there waits)."""
    if not optimizer.defaults.get("fused"):  # the unfused optimizers refuse grad_scale
        raise TypeError(f"clipped_step clips in a fused optimizer's own pass: make the "
                        f"{type(optimizer).__name__} with fused=True (make_optimizer does)")
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)  # over FSDP's shards: a DTensor
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    # AdamW.step reads these two attributes: torch.optim's hook for GradScaler's unscaling.
    if max_norm > 0:  # (with grad_scale set, AdamW also writes each divided gradient back)
        optimizer.grad_scale = ((norm + 1e-6) / max_norm).clamp(min=1.0).float()
    finite = torch.isfinite(norm) & torch.isfinite(loss.to(norm.device))
    optimizer.found_inf = (~finite).float()
    with out_of_memory_names("optimizer step"):
        try:
            optimizer.step()
        finally:
            optimizer.__dict__.pop("grad_scale", None)
            del optimizer.found_inf
    optimizer.zero_grad(set_to_none=True)
    return norm


# The loop: steps and what they leave (support/saved_state.py: the log, saves, a stop, the export).

def train_loop(cfg: Config, rt: Runtime, model, optimizer, data: TokenData, first_step: int,
               outputs: saved_state.Outputs, expected: dict | None = None) -> Run:
    """expected: the plan's predicted step, peak and allocator retries (plan.RunChoice's), which
    the closing line holds the run to."""
    args, is_main = model.args, rt.rank == 0
    header = progress.run_header(cfg, rt, args, first_step, expected)
    if is_main:
        print(progress.opening_text(cfg, rt, header, data))
    outputs.log(header)
    history, run_start = [], time.perf_counter()
    tokens_per_gpu = cfg.batch_size * cfg.grad_accum * cfg.seq_len * rt.dp / rt.world
    # Bars only on a terminal: written into a log file they would garble the step lines.
    show_bar = progress.on_a_terminal(is_main)
    per = "gpu" if rt.device.type == "cuda" else "rank"
    with progress.layer_bars(model, cfg.grad_accum, show_bar) as start_bar:
        for step in tqdm(range(first_step, cfg.steps), disable=not show_bar, desc="train",
                         leave=False):
            tokens = data.batch(step)  # the data position is the step: resuming needs nothing more
            documents = data.documents(step, tokens)  # None unless --documents
            if rt.device.type == "cuda":  # (the compute stream: 08's updates go on beside it)
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.current_stream().synchronize()
            start_bar(step)
            start = time.perf_counter()
            with errors.what_to_try_next(cfg, rt):  # an out-of-memory step says it
                metrics = train_step(model, optimizer, tokens, rt, cfg, step=step,
                                     documents=documents)
            if rt.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            record = progress.step_record(step, metrics, time.perf_counter() - start,
                                          tokens_per_gpu, documents, rt)
            history.append(record)
            if is_main:
                tqdm.write(progress.step_text(record, per))
            outputs.log(record)
            if outputs.after_step(model, optimizer, step):  # saves when due; True: a signal
                break  # stopped the run (every rank after the same step)
    optimizer_overlap.settle(optimizer)  # 08: the last step's updates, before anything reads them
    outputs.finish(model, args)  # --export-hf, unless stopped: the run is not finished then
    if is_main:
        print(progress.summary_line(history, tokens_per_gpu, time.perf_counter() - run_start,
                                    per, outputs.last_saved, saved_state.resume_command(sys.argv),
                                    expected), flush=True)
    return Run(history, model, optimizer)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--plan" in argv:  # this run's memory plan: plan.py, given the flags it reads
        import plan

        return plan.main(plan.planner_argv(argv))
    exit_on_error(lambda: train(parse_args(argv)))


if __name__ == "__main__":
    main()
