"""06 in training: Ulysses (P/R) x ring (R) through train.py's own build and step equals plain,
unsharded training (loss and every gradient), for heads that do not divide P but do divide
P/R, with --stack 2 (02's seam) and --stack 5 (05's stages each running the ring), dp x sp, and a
ring degree picked when none is given; eight ranks under torchrun equal one process. Packed
documents through the ring: tests/test_packed.py."""

import importlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks import run_ranks
from reference import (GPU_KERNELS, assert_matches, assert_step_matches, full, make_batch,
                       reference_loss_and_grads, relative_error, train_loss_and_grads, with_kernel)
from test_packed import write_token_file  # the tests' one writer of token files
from test_train import ROOT, read_log
from test_trainer import PARAMETERS_RTOL  # the parameters after Adam steps, and why

import model as llama
from base import kernels
from support import runtime, saved_state
from support.config import Config, resolve_techniques
from support.runtime import setup_runtime

train = importlib.import_module("train")

SEQ_LEN = 24  # divisible by lcm(2R, P) for every case below
for heads, kv in [(8, 2), (8, 1), (6, 2), (5, 5), (5, 1)]:  # registered in every rank's process
    llama.PRESETS.setdefault(f"tiny-{heads}q{kv}kv", replace(llama.get_model_args("tiny"),
                                                             n_heads=heads, n_kv_heads=kv))

# (query heads, KV heads, --stack, --sp, --ring (None: picked), the ring degree expected)
CASES = {
    2: [(8, 2, 2, 2, 2, 2),       # Ulysses 1 x ring 2
        (8, 2, 5, 2, 2, 2),       # Untied, every stage a ring
        (5, 5, 2, 2, None, 2),    # 5 heads cannot split over 2 ranks: the ring is picked
        (5, 1, 5, 2, None, 2)],   # MQA, Untied
    3: [(8, 2, 2, 3, None, 3)],   # 1 x 3: 8 heads over 3 ranks only as a ring
    4: [(8, 2, 2, 4, 2, 2),       # Ulysses 2 x ring 2
        (8, 2, 5, 4, 2, 2),       # Untied 2 x ring 2
        (6, 2, 2, 4, None, 2),    # 6 heads at P = 4: R = 2 picked, heads divide P/R = 2
        (5, 5, 5, 4, None, 4),    # 5 heads at P = 4: R = 4 (Ulysses 1 x ring 4)
        (8, 1, 5, 4, 2, 2),       # one KV head, replicated for the 2 Ulysses ranks
        (8, 2, 2, 4, 4, 4),       # 1 x 4
        (8, 2, 5, 2, 2, 2)],      # dp 2 x (Ulysses 1 x ring 2)
}


def _ring_training_matches_unsharded(cases):
    for n_heads, n_kv_heads, stack, sp, ring, expected_ring in cases:
        name = f"tiny-{n_heads}q{n_kv_heads}kv"
        cfg = resolve_techniques(Config(
            model=name, stack=stack, sp=sp, ring=ring, seq_len=SEQ_LEN, mlp_tile_tokens=8,
            loss_tile_tokens=8, keep_attention=False))
        rt = setup_runtime(cfg)
        assert rt.ring == expected_ring and rt.ulysses == sp // expected_ring
        tokens, labels = make_batch(256, 2 * rt.dp, SEQ_LEN, seed=n_heads, ignore_frac=0.2)
        ref_loss, ref_grads = reference_loss_and_grads(name, tokens, labels)
        loss, grads = train_loss_and_grads(cfg, tokens, labels, rt)
        what = (f"{n_heads} heads / {n_kv_heads} KV, --stack {stack}, dp {rt.dp} x "
                f"(Ulysses {rt.ulysses} x ring {rt.ring})")
        # The ring adds each query's keys in another order (merged partial softmaxes): compare
        # whole-tensor relative errors at fp32 rounding, as for 05's stages.
        assert_matches(loss, grads, ref_loss, ref_grads, what=what, norm_rtol=2e-6)
        if dist.get_rank() == 0:
            print(f"{what}: equal to unsharded training (loss {float(loss):.6f})")


@pytest.mark.parametrize("world_size", [world if world == 2 else pytest.param(
    world, marks=pytest.mark.slow) for world in sorted(CASES)])
def test_ulysses_times_ring_training_equals_unsharded(world_size):
    run_ranks(world_size, _ring_training_matches_unsharded, CASES[world_size])


def test_a_ring_degree_that_cannot_work_is_refused_at_start():
    args = llama.get_model_args("tiny")
    cfg = resolve_techniques(Config(model="tiny", stack=2, ring=3, seq_len=24))
    with pytest.raises(ValueError, match=r"ring degree R \(3\) must divide the sequence-parallel "
                                         r"degree P \(4\)"):
        runtime.check_layout(cfg, 4, args)
    cfg = resolve_techniques(Config(model="tiny", stack=2, ring=2, seq_len=20))
    with pytest.raises(ValueError, match=r"sequence length \(20\) must be divisible by 2R = 8"):
        runtime.check_layout(replace(cfg, ring=4), 4, args)
    with pytest.raises(ValueError, match=r"--ring must be at least 1, got 0"):  # not "picked"
        resolve_techniques(Config(model="tiny", stack=2, ring=0))
    with pytest.raises(ValueError, match="--ring is a setting of --ulysses or --untied"):
        resolve_techniques(Config(model="tiny", fsdp=True, ring=2))
    # heads that split over no P/R: named with the Ulysses rule (7 heads, 2 KV, P = 4: R = 4
    # leaves P/R = 1, which works, so ask for R = 2 explicitly)
    llama.PRESETS.setdefault("tiny-7q7kv", replace(args, n_heads=7, n_kv_heads=7))
    with pytest.raises(ValueError, match=r"query heads \(7\) to be divisible by the "
                                         r"sequence-parallel degree \(2\)"):
        cfg = resolve_techniques(Config(model="tiny-7q7kv", stack=2, ring=2,
                                        seq_len=24))
        runtime.check_layout(cfg, 4, args=llama.get_model_args("tiny-7q7kv"))


def _keep_attention_through_the_ring():
    """--keep-attention with a ring: the ring's output and log-sum-exp are kept with 03's
    checkpoint and the recompute takes them (no second ring), for 02's seam and 05's stages;
    loss and gradients still equal unsharded training."""
    for stack, untied in ((3, False), (5, True)):
        cfg = resolve_techniques(Config(
            model="tiny", stack=stack, ring=2, seq_len=SEQ_LEN, keep_attention=True,
            mlp_tile_tokens=8, loss_tile_tokens=8))
        rt = setup_runtime(cfg)
        tokens, labels = make_batch(256, 2, SEQ_LEN, ignore_frac=0.2)
        ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)
        model = train.build_model(cfg, rt)
        loss = train.forward_backward(model, tokens, rt, labels)
        grads = {n: full(p.grad) for n, p in model.named_parameters()}
        assert_matches(loss, grads, ref_loss, ref_grads,
                       what=f"--stack {stack} --keep-attention, ring 2", norm_rtol=2e-6)
        stats = model.kept_attention.stats
        layers = len(model.layers)
        assert stats["kept"] == layers and stats["taken"] == layers, (untied, stats)


@pytest.mark.slow
def test_keep_attention_keeps_the_rings_output():
    run_ranks(2, _keep_attention_through_the_ring)


def _ring_on_gpus_matches_fp32(stack):
    """Ulysses 1 x ring 2 on two GPUs over NCCL, bf16, against the fp32 unsharded reference."""
    cfg = resolve_techniques(Config(
        model="tiny-hd64", stack=stack, ring=2, seq_len=64, device="cuda", dtype="bfloat16",
        mlp_tile_tokens=16, loss_tile_tokens=16, keep_attention=False,
        attn_kernel=kernels._requested["kernel"]))
    rt = setup_runtime(cfg)
    assert rt.ring == 2
    tokens, labels = make_batch(256, 2, cfg.seq_len, seed=stack, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads("tiny-hd64", tokens, labels)
    loss, grads = train_loss_and_grads(cfg, tokens, labels, rt)
    grads = {n: g.float().cpu() for n, g in grads.items()}
    assert_step_matches(loss.float().cpu(), grads, ref_loss, ref_grads, "tiny-hd64", tokens,
                        labels, cfg.dtype, what=f"--stack {stack}, ring 2, NCCL bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("stack", [2, 5])
@pytest.mark.parametrize("kernel", GPU_KERNELS)
def test_ring_training_nccl_bf16_matches_fp32_reference(kernel, stack):
    run_ranks(2, with_kernel, kernel, _ring_on_gpus_matches_fp32, stack, backend="nccl")


# ---------------------------------------------------------------------------------------------
# Eight ranks end to end: torchrun, train.py's command line, the log and the saved weights
# ---------------------------------------------------------------------------------------------

EIGHT_RANKS = {  # layout -> (dp, sp, train.py's flags for a global batch of 2 windows a step)
    "dp 2 x (Ulysses 2 x ring 2)": (2, 4, ["--sp", "4", "--batch-size", "1"]),
    "dp 1 x (Ulysses 4 x ring 2), 2 micro-batches": (1, 8, ["--batch-size", "1",
                                                            "--grad-accum", "2"]),
}
UNDER_TORCHRUN = "dp 2 x (Ulysses 2 x ring 2)"  # the other in tests/ranks.py's ranks (2.5x faster)


@pytest.mark.slow
@pytest.mark.parametrize("layout", EIGHT_RANKS)
def test_eight_ranks_train_like_one_process(layout, tmp_path):
    """`torchrun --nproc-per-node 8 train.py --stack 5 --ring 2` on the tiny model (8 query, 2
    KV heads: at Ulysses 4 each KV head serves two ranks) with packed documents from a token
    file, against `python train.py` with the same global batch and no technique: every step's
    loss, gradient norm and lr at fp32 rounding, and the saved weights after the last step.
    One layout under torchrun itself; the other through train.py's command line in 8 ranks of
    tests/ranks.py (no launcher, no 8 imports of torch: 15 s instead of 35 on 2 cores)."""
    common = ["--seq-len", "64", "--steps", "3", "--data", str(token_file(tmp_path)),
              "--doc-sep", "255"]
    train.main(common + ["--batch-size", "2", "--save-dir", str(tmp_path / "one"),
                         "--log-file", str(tmp_path / "one.jsonl")])
    argv = ["--stack", "5", "--ring", "2", *common, *EIGHT_RANKS[layout][2],
            "--save-dir", str(tmp_path / "eight"), "--log-file", str(tmp_path / "eight.jsonl")]
    if layout == UNDER_TORCHRUN:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "8", "train.py", *argv],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        run_ranks(8, _train_from_the_command_line, argv)
    (header, eight), (_, one) = (read_log(tmp_path / f"{n}.jsonl") for n in ("eight", "one"))
    assert ((header["world_size"], header["dp"], header["sp"], header["ring"])
            == (8, *EIGHT_RANKS[layout][:2], 2)), header
    assert len(eight) == len(one) == 3
    for a, b in zip(eight, one):
        for key in ("loss", "grad_norm", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (layout, key, a, b)
        if header["dp"] == 1:  # the log counts rank 0's documents: the step's at dp 1 alone
            assert a["documents"] == b["documents"], (layout, a, b)
    weights = {}
    for name in ("eight", "one"):
        weights[name] = llama.Transformer(llama.get_model_args("tiny"))
        saved_state.load_model_state(str(tmp_path / name), weights[name])
    for (name, a), b in zip(weights["eight"].named_parameters(), weights["one"].parameters()):
        assert relative_error(a, b) < PARAMETERS_RTOL, (layout, name, relative_error(a, b))


def _train_from_the_command_line(argv):
    train.train(train.parse_args(argv))  # train.main's run, which would also end the group


def token_file(folder) -> Path:
    """Random documents of 1 to 60 tokens, each ending with 255, in a uint16 token file."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 255, (3 * 2 * 65,), generator=generator)
    ends = torch.randint(0, 60, (12,), generator=generator).cumsum(0)
    tokens[ends[ends < tokens.numel()]] = 255
    path = Path(folder, "tokens.bin")
    write_token_file(path, tokens)
    return path
