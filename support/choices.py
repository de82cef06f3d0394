"""choices.py - what training decides with the planner (plan.py) before the model is built:
Untied Ulysses' head chunk U (05), whether 03 keeps attention's outputs (--keep-attention), and
04's MLP tile (--mlp-tile-tokens).

A flag given wins. Left open, a GPU run takes what the plan says fits the smallest GPU (and, for
--keep-attention, the host); a CPU run, with no plan to go by, takes the defaults (U = P, the
least memory; no kept outputs; 04's MLP tile of about dim tokens). Every rank decides the same,
from the least memory any rank has: the all-to-alls and the step must match across ranks.
"""

from dataclasses import replace

import plan
from support.config import Config
from support.host_memory import least_host_memory, ranks_on_this_node
from support.runtime import Runtime


def choose_for_run(cfg: Config, rt: Runtime) -> tuple:
    """(head chunk U, keep attention, MLP tile tokens) for training `cfg` on `rt`, each planned
    with the ones chosen before it."""
    cfg = replace(cfg, head_chunk=choose_head_chunk(cfg, rt))
    cfg = replace(cfg, keep_attention=choose_keep_attention(cfg, rt))
    return cfg.head_chunk, cfg.keep_attention, choose_mlp_tile_tokens(cfg, rt)


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
              "skips attention: ~1.2x faster steps at long lengths); --no-keep-attention turns "
              "it off")
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


def choose_mlp_tile_tokens(cfg: Config, rt: Runtime) -> int | None:
    """04's MLP tile for this run: --mlp-tile-tokens as given; else on GPUs the largest tile
    the plan fits (plan.largest_mlp_tile_that_fits), said in a line; else None, 04's default
    of about dim tokens (the CPU: no plan)."""
    if not cfg.tile_mlp or cfg.mlp_tile_tokens is not None or rt.device.type != "cuda":
        return cfg.mlp_tile_tokens
    tile = plan.largest_mlp_tile_that_fits(cfg, rt.world, plan.smallest_gpu_memory(rt))
    if tile is not None and rt.rank == 0:
        print(f"--mlp-tile-tokens: {tile:,}, the largest tile the plan fits (fewer, larger "
              f"matmuls than 04's default of about dim tokens); give the flag to choose")
    return tile
