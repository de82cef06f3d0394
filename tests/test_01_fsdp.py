"""01_fsdp.py: sharded training takes the same steps as one process, and shards the bytes."""

import importlib

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from reference import full, make_batch

import model as llama

fsdp = importlib.import_module("01_fsdp")
train = importlib.import_module("train")

ROWS_PER_RANK, SEQ_LEN = 2, 32


def _fsdp_steps_match_single_process(steps, device="cpu", dtype="float32", rtol=1e-5, atol=1e-6):
    world = dist.get_world_size()
    cfg = train.Config(model="tiny", fsdp=True, seq_len=SEQ_LEN, batch_size=ROWS_PER_RANK,
                       device=device, dtype=dtype)
    rt = train.setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    optimizer = train.make_optimizer(model, cfg)
    # The reference: one process, no FSDP, fp32, the whole global batch.
    ref_cfg = train.Config(model="tiny", seq_len=SEQ_LEN, batch_size=ROWS_PER_RANK * world)
    ref_rt = train.Runtime()
    ref_model = train.build_model(ref_cfg, ref_rt)
    ref_optimizer = train.make_optimizer(ref_model, ref_cfg)
    mine = slice(rt.dp_rank * ROWS_PER_RANK, (rt.dp_rank + 1) * ROWS_PER_RANK)
    for step in range(steps):
        tokens, labels = make_batch(256, ROWS_PER_RANK * world, SEQ_LEN, seed=step, ignore_frac=0.2)
        ref = train.train_step(ref_model, ref_optimizer, tokens, ref_rt, ref_cfg, labels)
        got = train.train_step(model, optimizer, tokens[mine], rt, cfg, labels[mine])
        for key in ("loss", "grad_norm"):
            assert got[key] == pytest.approx(ref[key], rel=rtol, abs=atol), (step, key, got, ref)
    # Adam divides by sqrt(v): a gradient near its eps turns a 1e-7 relative difference into a
    # ~lr * 1e-3 step difference, so parameters get an absolute tolerance of a few lr * 1e-3.
    # (Adam is blind to a wrong gradient *scale*: the grad-norm check above is what catches it.)
    for (name, param), ref_param in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(full(param).float().cpu(), ref_param, rtol=rtol,
                                   atol=max(atol, 10 * cfg.lr * 1e-3),
                                   msg=lambda m: f"{name} after {steps} steps: {m}")


@pytest.mark.parametrize("world_size,steps", [(2, 1), (2, 3), (4, 3)])
def test_fsdp_steps_equal_single_process(world_size, steps):
    run_ranks(world_size, _fsdp_steps_match_single_process, steps)


def _local_numel_matches_formula(preset):
    from torch.distributed.device_mesh import init_device_mesh

    args = llama.get_model_args(preset)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    local = fsdp.sharded_numel_on_meta(args, mesh)
    per_rank = fsdp.model_state_bytes(args, dist.get_world_size())["parameters"] // 4
    # FSDP pads each parameter's dim 0 to a multiple of the world size; the formula pads once.
    assert abs(local - per_rank) <= args.n_layers * 16 * args.dim, (local, per_rank)
    assert local < llama.num_params(args) / dist.get_world_size() * 1.001


def test_sharded_bytes_match_the_formula():
    """The bytes FSDP really allocates per rank (counted on the meta device) match the formula
    the demo and the planner use, for the real 8B shapes."""
    run_ranks(2, _local_numel_matches_formula, "llama3-8b")


def test_llama3_8b_model_state_per_gpu():
    args = llama.get_model_args("llama3-8b")
    assert sum(fsdp.model_state_bytes(args, 1).values()) / 2**30 == pytest.approx(119.7, abs=0.1)
    assert sum(fsdp.model_state_bytes(args, 8).values()) / 2**30 == pytest.approx(15.0, abs=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_fsdp_nccl_bf16_matches_fp32_reference():
    run_ranks(2, _fsdp_steps_match_single_process, 3, "cuda", "bfloat16", 3e-2, 3e-2,
              backend="nccl")
