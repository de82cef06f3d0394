"""What a trainer is expected to do, and the traps of a first run: gradient accumulation, the
learning-rate schedule and its default per model size, the closing summary and the progress bars,
--keep-attention decided from the plan, errors printed once under torchrun, one rule for the
outputs' folders."""

import importlib
import io
import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from reference import (assert_within_bf16_error, full, parameter_updates, relative_error,
                       techniques_applied, techniques_of)
from test_01_fsdp import _train_recording_grads  # steps, and the gradients the optimizer saw
from test_train import error_of, run_script  # train.main's error text; a fresh process

import plan as planner
from support import config, errors, progress, saved_state
from support.runtime import Runtime, setup_runtime
from support.config import Config, resolve_techniques
from support.data import TokenData

train = importlib.import_module("train")
ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


# ---------------------------------------------------------------------------------------------
# Silently accepted flags, now refused; one rule for the outputs' folders
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle,absent", [
    (["--init-from", "some/folder", "--model", "tiny"],
     "--model tiny and --init-from: the --init-from folder's config.json names the model", None),
    (["--rope-factor", "0.5"], "--rope-factor must be a finite number >= 1", None),
    (["--steps", "0"], "--steps must be at least 1, got 0", None),
    (["--steps", "-5"], "--steps must be at least 1, got -5", "--batch-size"),
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0", "--steps"),
    (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0", "--batch-size"),
    (["--seq-len", "abc"], "cannot read a token count from 'abc'", None),
    (["--min-lr", "0.1", "--lr", "0.01"], "--min-lr (0.1) must be at most --lr (0.01)", None),
    # contradictory or incomplete flags: refused before any work, not left to a traceback or
    # silently ignored
    (["--save-dir", "some/runs", "--resume", "--overwrite"],
     "--resume continues the checkpoints that --overwrite deletes; pick one", None),
    (["--resume"], "--resume needs --save-dir", None),
    (["--keep-attention"], "--keep-attention is a setting of --checkpoint (03)", None),
])
def test_flags_once_accepted_silently_are_refused(argv, needle, absent, capsys):
    err = error_of(argv, capsys)
    assert needle in err, err
    assert absent is None or absent not in err, err


def test_a_resume_already_at_its_steps_still_ends_well(tmp_path, capsys):
    """--steps 0 is refused; a --resume whose saved state is at --steps already has nothing to do
    and says so (a scheduler restarting a finished job is not an error)."""
    argv = ["--seq-len", "32", "--steps", "1", "--save-dir", str(tmp_path)]
    train.main(argv)
    capsys.readouterr()
    train.main(argv + ["--resume"])
    assert "already at step 1 = --steps; nothing to train" in capsys.readouterr().out


def test_the_log_files_folders_are_created_after_every_check(tmp_path, capsys):
    log = tmp_path / "runs" / "today" / "log.jsonl"
    # A check that fails (a missing --data file): nothing is created.
    assert "does not exist" in error_of(["--log-file", str(log),
                                         "--data", str(tmp_path / "no.bin")], capsys)
    assert not (tmp_path / "runs").exists()
    train.main(["--log-file", str(log), "--seq-len", "32", "--steps", "1",
                "--save-dir", str(tmp_path / "saves" / "a")])
    assert len(log.read_text().splitlines()) == 2 and (tmp_path / "saves" / "a").is_dir()
    (tmp_path / "a_file").write_text("x")
    assert "cannot be written: " in error_of(["--log-file", str(tmp_path / "a_file" / "log.jsonl")],
                                             capsys)


# ---------------------------------------------------------------------------------------------
# Errors under torchrun: printed once, first; a rank's own error by that rank
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [["--model", "llama5"], ["--steps", "abc"]])
@pytest.mark.slow
def test_an_error_every_rank_meets_is_printed_once_under_torchrun(bad):
    result = run_script("-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py",
                        "--stack", "1", *bad)
    assert result.returncode != 0
    err = result.stderr
    needle = "unknown model preset 'llama5'" if "llama5" in bad else "invalid int value: 'abc'"
    assert err.count(needle) == 1, err
    assert err.index(needle) < err.find("ChildFailedError") or "ChildFailedError" not in err, err


@pytest.mark.parametrize("rank,error,printed", [
    ("1", errors.StepOutOfMemory("out of GPU memory in the forward"),
     "[rank 1] error: out of GPU memory"),
    ("0", errors.StepOutOfMemory("out of GPU memory in the forward"),
     "[rank 0] error: out of GPU memory"),
    ("1", ValueError("bad flag"), ""),
    ("0", ValueError("bad flag"), "error: bad flag"),
])
def test_a_ranks_own_error_is_printed_by_that_rank(rank, error, printed, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setattr(errors.time, "sleep", lambda s: None)

    def fail():
        raise error

    with pytest.raises(SystemExit):
        errors.exit_on_error(fail)
    err = capsys.readouterr().err
    assert (printed in err) if printed else err == "", err


def test_one_is_singular():
    cfg = resolve_techniques(Config(model="llama3-8b", seq_len=2**20, stack=5,
                                    dtype="bfloat16", device="cpu"))
    assert "this node's 1 rank, " in planner.host_memory_error(cfg, 1, 1, 10 * GiB)
    assert "this node's 2 ranks, " in planner.host_memory_error(cfg, 2, 2, 10 * GiB)


# ---------------------------------------------------------------------------------------------
# Gradient accumulation: --grad-accum N is --batch-size N (every loss and weight)
# ---------------------------------------------------------------------------------------------

def _grad_accum_equals_the_larger_batch(cases: list):
    """Each (flags, N): --grad-accum N equals --batch-size N. Losses and gradient norms within
    fp32 summation order (the micro-batches' summed losses add in another order than one
    batch's; at P > 1 the gradients are reduce-scattered N times): 1e-5 relative. Weights within
    5% of one step's lr: AdamW moves a weight by about lr g / (|g| + eps), so a component whose
    gradient is near its eps (1e-8) moves by up to lr |dg| / (4 eps) for a rounding difference dg
    between the two summation orders; fp32 sums of this size round by ~1e-9, 2.5% of a step (seen
    once: 2.4%, one element of the embedding). A dropped or doubled micro-batch moves the loss
    (1e-5) and most weights by a whole step. Each step's tokens/s counts all N micro-batches."""
    for flags, n in cases:
        base = dict(model="tiny", seq_len=32, steps=3, lr=3e-3, **flags)
        accumulated = train.train(resolve_techniques(Config(batch_size=1,
                                                            grad_accum=n, **base)))
        larger = train.train(resolve_techniques(Config(batch_size=n, **base)))
        assert len(accumulated.history) == len(larger.history) == 3
        for a, b in zip(accumulated.history, larger.history):
            assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (flags, n, a, b)
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (flags, n, a, b)
            # tokens/s counts every micro-batch: the same tokens a step as the larger batch
            # (within the step times' rounding to 0.1 ms)
            tokens_a, tokens_b = (r["tokens_per_s_per_gpu"] * r["step_time_s"] for r in (a, b))
            assert math.isclose(tokens_a, tokens_b, rel_tol=0.05), (flags, n, a, b)
        for (name, a), b in zip(accumulated.model.named_parameters(), larger.model.parameters()):
            torch.testing.assert_close(full(a), full(b), rtol=0, atol=0.05 * base["lr"],
                                       msg=lambda m: f"{flags}, N {n}, {name}: {m}")


@pytest.mark.parametrize("flags,n", [({}, 2), ({"doc_sep": 0}, 2), ({"doc_sep": 0}, 3)],
                         ids=["plain", "documents", "documents-3"])
def test_grad_accum_equals_the_larger_batch_one_process(flags, n):
    _grad_accum_equals_the_larger_batch([(flags, n)])


def test_grad_accum_equals_the_larger_batch_two_ranks():
    """--stack 5; with packed documents through the ring (06, Ulysses 1 x ring 2); with the model
    state on the host (01's --offload-model-state: the gradients accumulate in host memory)."""
    run_ranks(2, _grad_accum_equals_the_larger_batch, [
        ({"stack": 5}, 2), ({"stack": 5, "ring": 2, "doc_sep": 0}, 3),
        ({"stack": 5, "offload_model_state": True, "doc_sep": 0}, 3)])


def test_grad_accum_equals_the_larger_batch_one_rank_fsdp():
    """FSDP over one rank reduces in place (01): a micro-batch's gradients are the memory
    FSDP2 asked for as its input, handed back as the output; a buffer kept from an earlier
    reduce and handed out again would mix the micro-batches'."""
    run_ranks(1, _grad_accum_equals_the_larger_batch, [({"fsdp": True}, 2), ({"stack": 5}, 3)])


@pytest.mark.slow
def test_grad_accum_equals_the_larger_batch_dp_2_x_sp_2():
    run_ranks(4, _grad_accum_equals_the_larger_batch, [
        ({"stack": 5, "sp": 2}, 2), ({"stack": 5, "sp": 2, "doc_sep": 0}, 3)])


def test_forward_backward_refuses_rows_that_do_not_split_and_labels_beside_documents():
    """forward_backward's own checks (code may call it, as the tests and benches do): 3 rows
    into 2 micro-batches is refused (not run as 3 of one row), and labels given beside packed
    documents, which carry their own, are refused (not one of them silently dropped)."""
    cfg = resolve_techniques(Config(model="tiny", seq_len=32, batch_size=3, doc_sep=7))
    rt = setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    data = TokenData(cfg, model.args.vocab_size, 0, 1)
    tokens = data.batch(0)
    with pytest.raises(ValueError, match="3 rows do not split into 2 micro-batches"):
        train.forward_backward(model, tokens, rt, micro_batches=2)
    with pytest.raises(ValueError, match="pass labels or documents"):
        train.forward_backward(model, tokens, rt, labels=tokens[:, 1:],
                               documents=data.documents(0, tokens))
    assert all(p.grad is None for p in model.parameters())  # refused before any backward


def test_grad_accum_is_saved_and_a_changed_one_refused(tmp_path, capsys):
    argv = ["--seq-len", "32", "--steps", "1", "--save-dir", str(tmp_path), "--grad-accum", "2"]
    train.main(argv)
    meta = json.loads(Path(saved_state.complete_saves(str(tmp_path))[-1], "meta.json").read_text())
    assert meta["grad_accum"] == 2
    err = error_of(["--seq-len", "32", "--steps", "2", "--save-dir", str(tmp_path), "--resume"],
                   capsys)
    assert "was trained with --grad-accum 2, this run asks for 1" in err


def test_the_planner_holds_the_gradients_across_micro_batches():
    """From the second micro-batch on, the gradients so far are held through its forward and
    backward: the sharded gradients under FSDP; with the model state on the host, none."""
    cfg = resolve_techniques(Config(model="llama3-8b", seq_len=2**17, stack=5,
                                    dtype="bfloat16", device="cpu", head_chunk=8))
    grads = planner.byte_counts.model_state_bytes(planner.model_args(cfg), 8)["gradients"]
    one, two = (planner.plan_memory(replace(cfg, grad_accum=n), 8) for n in (1, 2))
    for moment in ("end of forward (loss)", "backward of the last layer"):
        assert (two["moments"][moment]["model_state"] - one["moments"][moment]["model_state"]
                == grads), moment
    assert two["moments"]["backward of layer 0"]["model_state"] == \
        one["moments"]["end of backward"]["model_state"]  # every gradient, as at the end
    assert two["peak"] >= one["peak"]
    on_host = replace(cfg, offload_model_state=True)
    assert (planner.plan_memory(replace(on_host, grad_accum=2), 8)["peak"]
            == planner.plan_memory(on_host, 8)["peak"])
    assert "--grad-accum" in planner.planner_argv(["--grad-accum", "2", "--lr", "1e-3"])


# ---------------------------------------------------------------------------------------------
# The training flags, and techniques outside their --stack: equal to one plain process
# ---------------------------------------------------------------------------------------------

# The reference takes these, not the techniques: training's and the rotary settings (context
# extension: the model's own, applied at the global positions every shard is given).
TRAINING_FLAGS = ("weight_decay", "grad_clip")
REFERENCE_FLAGS = TRAINING_FLAGS + ("rope_theta", "rope_scaling", "rope_factor",
                                    "rope_original_context")
# The parameters after 3 steps, each tensor's relative error. Not elementwise: Adam's first update
# of a gradient near its eps (1e-8) is lr g / (|g| + eps), so a 3e-10 rounding difference in
# g = -2.6e-9 (05's stages through the ring) moves that weight by 2% of lr (seen: 1 of 8192).
# Whole tensors: 3e-5 seen; a step missed, doubled or at another lr moves them by ~lr / |w|
# (0.1); weight decay's absence by lr x decay x steps (9e-4 here).
PARAMETERS_RTOL = 1e-4


def _flags_train_like_one_process(cases):
    """Each case: 3 steps with its flags on these ranks equal 3 steps of the plain model in one
    process with its training flags: loss and gradient norm of each step, every gradient of the
    first as the optimizer sees it (after clipping) and the parameters after. A training flag
    is also shown to act: clipped gradients have the --grad-clip norm (0: no clip, though the
    norm exceeds the default's), and --weight-decay moves the weights beyond the tolerance,
    against the reference without it. The techniques named are checked to run in the model."""
    world = torch.distributed.get_world_size()
    for flags in cases:
        cfg = resolve_techniques(Config(model="tiny", seq_len=32, batch_size=2,
                                        lr=3e-3, **flags))
        dp = world // (cfg.sp or world) if cfg.ulysses or cfg.untied else world
        model, _, metrics, grads = _train_recording_grads(cfg, 3)
        training = {k: v for k, v in flags.items() if k in TRAINING_FLAGS}
        shared = {k: v for k, v in flags.items() if k in REFERENCE_FLAGS}
        reference = resolve_techniques(Config(model="tiny", seq_len=32,
                                              batch_size=2 * dp, lr=3e-3, **shared))
        ref_model, _, ref_metrics, ref_grads = _train_recording_grads(reference, 3, Runtime())
        for step, (got, want) in enumerate(zip(metrics, ref_metrics)):
            for key in ("loss", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (flags, step, key)
        # The first step's gradients, at the same weights (seen: 5e-7; 05 and the ring add in
        # another order). Later ones are taken at weights that Adam has already moved apart
        # by its eps-amplified rounding (2.6e-5 seen): the parameters below bound those.
        for name, ref in ref_grads[0].items():
            assert relative_error(grads[0][name], ref) < 1e-5, (flags, name)
        for (name, param), ref in zip(model.named_parameters(), ref_model.parameters()):
            error = relative_error(full(param), ref)
            assert error < PARAMETERS_RTOL, (flags, name, error)
        applied = techniques_applied(model)
        assert applied == techniques_of(resolve_techniques(cfg)), (flags, applied)
        for key in set(shared) - set(training):  # the sharded model has the rotary settings
            assert getattr(model.args, key) == flags[key], (flags, key)
        if "grad_clip" in training:
            check_the_clip_acts(cfg.grad_clip, ref_metrics, ref_grads)
        if "weight_decay" in training:
            undecayed = replace(reference, weight_decay=0.0)
            plain = _train_recording_grads(undecayed, 3, Runtime())[0]
            moved = max(relative_error(a, b)
                        for a, b in zip(ref_model.parameters(), plain.parameters()))
            assert moved > 5 * PARAMETERS_RTOL, (flags, moved)  # lr x decay x 3 steps: 9e-4


def check_the_clip_acts(clip: float, metrics, grads):
    """Where the norm exceeds the clip the optimizer's gradients have the clip's norm; 0 turns
    clipping off (not a clip to 0), at norms the default clip would have cut."""
    seen = [math.sqrt(sum(float(g.double().norm()) ** 2 for g in step.values())) for step in grads]
    norms = [m["grad_norm"] for m in metrics]
    if clip == 0:
        assert seen == pytest.approx(norms, rel=1e-5)
        assert max(norms) > config.DEFAULTS.grad_clip, norms  # else the default would not clip
        return
    assert any(n > clip for n in norms), (clip, norms)  # it clips
    assert seen == pytest.approx([min(n, clip) for n in norms], rel=1e-5), (clip, seen, norms)


# (techniques, training flags): the flags under the whole stack, the clip over the host-resident
# shards (with the ring); 05 at --stack 2 and 3, where it replaces 02; 04's norm tiles with 05
# and with the ring; yarn context extension (pretrained at 8 tokens, trained at 32) through 05 x
# the ring.
FLAG_CASES = [{"stack": 5, "weight_decay": 0.1},
              {"stack": 5, "grad_clip": 0.5, "offload_model_state": True, "ring": 2},
              {"stack": 5, "grad_clip": 0},
              {"stack": 2, "untied": True},
              {"stack": 3, "untied": True},
              {"stack": 4, "untied": True, "tile_norm": True},
              {"stack": 5, "ring": 2, "tile_norm": True},
              {"stack": 3, "ring": 2, "tile_norm": True},
              {"stack": 5, "ring": 2, "rope_scaling": "yarn", "rope_factor": 4.0,
               "rope_original_context": 8, "rope_theta": 1e4}]


def test_flags_without_a_lesson_train_like_one_process():
    run_ranks(2, _flags_train_like_one_process, FLAG_CASES)


def _model_and_optimizer(cfg):
    model = train.build_model(cfg, Runtime())  # seeded: the same weights each time
    return model, train.make_optimizer(model, cfg)


@pytest.mark.parametrize("clip", [0.05, 0.0, 1e3])  # clips; off; above the norm
def test_the_clip_in_adamws_pass_moves_the_weights_as_clip_grad_norm_does(clip):
    """train.clipped_step clips in fused AdamW's own pass (its grad_scale): the weights after
    it are those of clip_grad_norm_ then a plain step (fp32; a division against a
    multiplication: an ulp), and not those of an unclipped step where it clips."""
    cfg = resolve_techniques(Config(model="tiny", seq_len=32, batch_size=2, lr=3e-3))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    model, optimizer = _model_and_optimizer(cfg)
    norm = train.clipped_step(model, optimizer, train.forward_backward(model, tokens, Runtime()),
                              clip)
    weights = {}
    for clip_before in (clip, 0.0):
        plain, plain_optimizer = _model_and_optimizer(cfg)
        train.forward_backward(plain, tokens, Runtime())
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), clip_before or math.inf)
        plain_optimizer.step()
        weights[clip_before] = list(plain.parameters())
    assert float(norm) == pytest.approx(float(want), rel=1e-6)
    got = list(model.parameters())
    for mine, clipped in zip(got, weights[clip]):
        torch.testing.assert_close(mine, clipped, rtol=1e-6, atol=1e-8)
    moved = max(relative_error(a, b) for a, b in zip(got, weights[0.0]))
    if 0 < clip < float(norm):  # the clip's smaller steps (Adam's first step is ~lr x sign(g)
        assert moved > 1e-4, moved  # but for eps: the clip shows where |g| is near eps)
    else:
        assert moved < 1e-6, moved


@pytest.mark.parametrize("broken, clip", [("loss", 1.0), ("gradient", 1.0), ("gradient", 0.0)])
def test_a_non_finite_step_leaves_weights_and_optimizer_state_as_they_were(broken, clip):
    """A non-finite loss, or a finite loss with an inf gradient (an overflow in backward: found_inf
    reads the gradient norm too), updates nothing, clipped or not."""
    cfg = resolve_techniques(Config(model="tiny", seq_len=32, batch_size=2, lr=3e-3))
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    model, optimizer = _model_and_optimizer(cfg)
    train.clipped_step(model, optimizer, train.forward_backward(model, tokens, Runtime()), clip)
    before = [t.clone() for t in model.parameters()]
    state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()]
    loss = train.forward_backward(model, tokens, Runtime())
    if broken == "loss":
        loss = loss * float("nan")
    else:
        model.layers[0].mlp.up_proj.weight.grad[0, 0] = float("inf")
    norm = train.clipped_step(model, optimizer, loss, clip)
    if broken == "loss":
        assert math.isfinite(float(norm))  # the loss alone stops the step
    else:
        assert math.isfinite(float(loss)) and not math.isfinite(float(norm))  # the norm says why
    for p, was, saved in zip(model.parameters(), before, state):
        assert torch.equal(p, was)
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, saved[key]), key  # Adam's moments and its step count
    assert all(p.grad is None for p in model.parameters())  # zeroed for the next step
    unfused = torch.optim.AdamW(model.parameters(), foreach=False)
    with pytest.raises(TypeError, match="make the AdamW with fused=True"):
        train.clipped_step(model, unfused, loss, clip)


# ---------------------------------------------------------------------------------------------
# The learning rate: its schedule, and its default per model size
# ---------------------------------------------------------------------------------------------

def test_the_schedule_follows_its_formula():
    # min-lr is not MIN_LR_FRACTION x lr (1e-4): a schedule that ignored it would still pass.
    lr, low, warmup, steps = 1e-3, 2.5e-4, 10, 110
    for schedule in config.LR_SCHEDULES:
        cfg = resolve_techniques(Config(lr=lr, min_lr=low, warmup_steps=warmup,
                                        steps=steps, lr_schedule=schedule))
        for step in (0, 4, 9):
            assert config.learning_rate(cfg, step) == pytest.approx(lr * (step + 1) / warmup)
        for step in (10, 35, 60, 85, 109, 110):
            progress = (step - warmup) / (steps - warmup)
            expected = {"constant": lr,
                        "cosine": low + (lr - low) * 0.5 * (1 + math.cos(math.pi * progress)),
                        "linear": lr - (lr - low) * progress}[schedule]
            assert (config.learning_rate(cfg, step)
                    == pytest.approx(expected, rel=1e-12)), (schedule, step)
    cosine = resolve_techniques(Config(lr=lr, lr_schedule="cosine", steps=100))
    assert cosine.min_lr == pytest.approx(0.1 * lr)  # --min-lr's default
    assert config.learning_rate(cosine, 50) == pytest.approx(0.1 * lr + 0.9 * lr * 0.5)


def test_flags_at_their_bounds_are_accepted():
    """Each check's bound itself is valid, not refused: --min-lr equal to --lr (a flat decay),
    --mlp-tile-tokens with --tile-norm alone (the norm's tile size) or --tile-mlp alone,
    --steps 2^31, --seed 2^32 - 1, 2^31 tokens in one sequence or a step's micro-batches,
    --rope-factor 1 (no stretch); and --stack auto in any case."""
    cfg = train.parse_args(["--lr", "1e-3", "--min-lr", "1e-3", "--lr-schedule", "cosine",
                            "--steps", "10", "--tile-norm", "--mlp-tile-tokens", "16"])
    assert cfg.min_lr == cfg.lr == 1e-3
    assert all(config.learning_rate(cfg, step) == pytest.approx(1e-3) for step in range(11))
    assert cfg.tile_norm and not cfg.tile_mlp and cfg.mlp_tile_tokens == 16
    cfg = train.parse_args(["--steps", str(2**31), "--seed", str(2**32 - 1), "--seq-len", "2048M",
                            "--rope-scaling", "yarn", "--rope-factor", "1",
                            "--tile-mlp", "--mlp-tile-tokens", "16"])
    assert (cfg.steps, cfg.seed, cfg.seq_len, cfg.rope_factor) == (2**31, 2**32 - 1, 2**31, 1)
    assert cfg.tile_mlp and not cfg.tile_norm and cfg.mlp_tile_tokens == 16
    step = train.parse_args(["--seq-len", "1024M", "--grad-accum", "2"])
    assert step.seq_len * step.grad_accum == 2**31
    assert train.parse_args(["--stack", " AUTO "]).stack == "auto"


def test_a_config_made_in_code_is_checked_like_the_flags():
    """resolve_techniques refuses what argparse never lets through the command line (a bench or
    a test builds its Config in code): a negative --steps, an unknown --lr-schedule (which the
    schedule would silently take for linear)."""
    with pytest.raises(ValueError, match="--steps must be at least 0, got -1"):
        resolve_techniques(Config(steps=-1))
    with pytest.raises(ValueError, match="--lr-schedule must be one of constant, cosine, linear, "
                                         "got 'cosin'"):
        resolve_techniques(Config(lr_schedule="cosin"))


def test_the_optimizer_steps_at_the_schedules_learning_rate(monkeypatch):
    """train.py's run (the flags parsed), at each step: the learning rate its optimizer steps
    with is the formula's, computed here: --warmup-steps W linear to --lr, then cosine or linear
    from --lr at step W towards --min-lr at --steps (the last step, --steps - 1, a step short of
    it), --min-lr's default a tenth of --lr. A --min-lr of 2.5e-4 moves every step after W."""
    seen = []  # the learning rate of each optimizer.step, as the optimizer holds it then
    make_optimizer = train.make_optimizer

    def recording_optimizer(model, cfg):
        optimizer = make_optimizer(model, cfg)
        optimizer.register_step_pre_hook(lambda opt, *_: seen.append(opt.param_groups[0]["lr"]))
        return optimizer

    monkeypatch.setattr(train, "make_optimizer", recording_optimizer)
    peak, warmup, steps = 1e-3, 2, 6
    shapes = {"cosine": lambda done: 0.5 * (1 + math.cos(math.pi * done)),
              "linear": lambda done: 1 - done}
    for schedule, shape in shapes.items():
        per_floor = {}
        for floor in (None, 2.5e-4):
            seen.clear()
            train.train(train.parse_args(
                ["--seq-len", "16", "--steps", str(steps), "--lr", str(peak),
                 "--warmup-steps", str(warmup), "--lr-schedule", schedule]
                + ([] if floor is None else ["--min-lr", str(floor)])))
            low = 0.1 * peak if floor is None else floor
            want = [peak * (step + 1) / warmup if step < warmup
                    else low + (peak - low) * shape((step - warmup) / (steps - warmup))
                    for step in range(steps)]
            assert seen == pytest.approx(want, rel=1e-12), (schedule, floor)
            per_floor[floor] = seen[:]
        default, given = per_floor[None], per_floor[2.5e-4]
        assert default[:warmup + 1] == given[:warmup + 1]  # the warmup and the peak: unchanged
        assert all(g > d for d, g in zip(default[warmup + 1:], given[warmup + 1:])), schedule


@pytest.mark.slow
def test_each_log_line_carries_its_lr(tmp_path):
    log = tmp_path / "log.jsonl"
    result = run_script("train.py", "--seq-len", "32", "--steps", "4", "--lr", "1e-3",
                        "--lr-schedule", "linear", "--min-lr", "0", "--log-file", str(log))
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line) for line in log.read_text().splitlines()[1:]]
    assert [s["lr"] for s in steps] == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert "lr 0.00075 |" in result.stdout
    assert "lr 0.001, linear to 0 at step 4" in result.stdout.splitlines()[0]


def test_a_changed_schedule_on_resume_is_said(tmp_path, capsys):
    argv = ["--seq-len", "32", "--save-dir", str(tmp_path), "--lr", "1e-3"]
    train.main(argv + ["--steps", "1"])
    meta = json.loads(Path(saved_state.complete_saves(str(tmp_path))[-1], "meta.json").read_text())
    assert (meta["lr_schedule"], meta["min_lr"]) == ("constant", pytest.approx(1e-4))
    capsys.readouterr()
    train.main(argv + ["--steps", "2", "--resume", "--lr-schedule", "cosine"])
    out = capsys.readouterr().out
    assert "--lr-schedule cosine --min-lr 0.0001 --steps 2 from the command line" in out, out
    assert "lr schedule constant, min lr 0.0001, steps 1)" in out, out


@pytest.mark.parametrize("flags,lr", [
    ({"model": "tiny"}, 3e-3), ({"model": "small"}, 3e-3), ({"model": "qwen3-0.6b"}, 3e-4),
    ({"model": "llama3.2-1b"}, 3e-4), ({"model": "llama3-8b"}, 1.5e-4),
    ({"model": "llama3-70b"}, 1.5e-4),
    ({"model": "llama3-8b", "lr": 1e-5}, 1e-5),
])
def test_the_default_lr_follows_the_model_size(flags, lr):
    assert resolve_techniques(Config(**flags)).lr == lr


@pytest.mark.parametrize("n_params,lr", [(10**8 - 1, 3e-3), (10**8, 3e-4), (7 * 10**9 - 1, 3e-4),
                                         (7 * 10**9, 1.5e-4)])
def test_the_default_lr_steps_down_at_100m_and_7b_parameters(n_params, lr, monkeypatch):
    """--help's promise: 3e-3 below 100M parameters, 3e-4 below 7B, 1.5e-4 from 7B (no preset
    lies between 6M and 0.6B parameters, so a model of --init-from's size says it)."""
    monkeypatch.setattr(config, "num_params", lambda args: n_params)
    assert config.default_lr(Config()) == lr


@pytest.mark.slow
def test_the_default_lr_of_init_from_is_fine_tuning_and_printed(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, vocab_size=256,
                                  max_position_embeddings=256)
    transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path / "hf")
    assert config.default_lr(Config(init_from=str(tmp_path / "hf"))) == 2e-5
    result = run_script("train.py", "--init-from", str(tmp_path / "hf"), "--seq-len", "32",
                        "--steps", "1")
    assert result.returncode == 0, result.stderr
    assert "lr 2e-05 (--lr's default for --init-from)" in result.stdout.splitlines()[0]
    help_text = run_script("train.py", "--help").stdout
    assert "default by model size" in " ".join(help_text.split())


# ---------------------------------------------------------------------------------------------
# The closing summary; bars on a terminal only
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_summary_closes_the_run_and_no_bar_reaches_a_pipe(tmp_path):
    result = run_script("train.py", "--seq-len", "32", "--steps", "3", "--device", "cpu",
                        "--save-dir", str(tmp_path / "saves"))
    assert result.returncode == 0, result.stderr
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("done: 3 steps (0-2) in ") and "tok/s/rank (mean)" in last, last
    assert "saved state " + str(tmp_path / "saves" / "step_00000003") in last, last
    assert "--resume" in last
    for text in (result.stdout, result.stderr):
        assert ("\r" not in text and "it/s" not in text and "layer/s" not in text
                and "%|" not in text)


def test_the_summary_holds_a_planned_run_to_its_plan():
    """On a GPU the plan's prediction closes the run: the median step after the first against
    the predicted, the peak against the planned, and the allocator's retries after the first
    step where more than the plan priced (each a flush of its cache and a wait), with what
    leaves more memory free; without a plan, or without a GPU's peaks, no such line."""
    def record(step, seconds, retries):
        return {"step": step, "loss": 5.0 - step, "step_time_s": seconds,
                "peak_gpu_mem_gib": 70.0 + step / 100, "alloc_retries_so_far": retries}

    history = [record(0, 9.0, 2), record(1, 0.9, 2), record(2, 0.8, 3), record(3, 1.1, 5)]
    expected = {"step_s": 0.88, "peak_gib": 70.02, "retries_per_step": 0,
                "more_free": "--checkpoint-layers 20"}
    lines = progress.summary_line(history, 16384, 12.0, "gpu", None, None, expected).split("\n")
    assert lines[0].startswith("done: 4 steps (0-3)") and len(lines) == 2
    assert lines[1] == ("against the plan: median step 0.900s (predicted 0.880s), peak 70.03 GiB "
                        "(planned 70.02); the allocator gave its cache back and retried 3 times "
                        "after the first step (0 priced by the plan), each a wait on the GPU: a "
                        "plan that leaves more memory free at its peak avoids that "
                        "(--checkpoint-layers 20, for one)")
    even = history[:3]  # two steps after the first: the median of an even count
    assert "median step 0.850s" in progress.summary_line(even, 1, 1.0, "gpu", None, None,
                                                         expected)
    priced = dict(expected, retries_per_step=1)  # the plan priced one a step: 3 after 3 steps
    no_rates = dict(priced, step_s=None, more_free=None)  # no speed rates: the peak alone
    assert progress.summary_line(history, 16384, 12.0, "gpu", None, None, no_rates).endswith(
        "\nagainst the plan: median step 0.900s, peak 70.03 GiB (planned 70.02)")
    more = [dict(h, alloc_retries_so_far=2 + 2 * h["step"]) for h in history]  # 6 > 3 priced
    assert progress.summary_line(more, 1, 1.0, "gpu", None, None, no_rates).endswith(
        "retried 6 times after the first step (3 priced by the plan), each a wait on the GPU: "
        "a plan that leaves more memory free at its peak avoids that")
    one = progress.summary_line(history[:1], 16384, 12.0, "gpu", None, None, expected)
    assert "median step 9.000s (the first step: it also compiles and allocates)" in one
    cpu = [dict(h, peak_gpu_mem_gib=None) for h in history]
    for plan in (None, expected):  # no GPU's peaks: no line, planned or not
        assert "\n" not in progress.summary_line(cpu, 16384, 12.0, "rank", None, None, plan)


def test_the_layer_bar_counts_each_blocks_forward_and_backward(monkeypatch):
    """With 03's checkpointing (whose recompute must not count twice) and 2 micro-batches."""
    counted, closed = {}, []

    class CountedBar(progress.tqdm):
        def close(self):  # tqdm may close a bar twice
            closed.append(self)  # held: a later bar cannot reuse its id
            counted[id(self)] = (self.n, self.total)
            super().close()

    monkeypatch.setattr(progress, "tqdm", CountedBar)
    cfg = resolve_techniques(Config(model="tiny", seq_len=32, checkpoint=True,
                                    grad_accum=2))
    rt = setup_runtime(cfg)
    model = train.build_model(cfg, rt)
    optimizer = train.make_optimizer(model, cfg)
    passes = 2 * 2 * len(model.layers)  # forward and backward of each block, per micro-batch
    with progress.layer_bars(model, cfg.grad_accum, True, file=io.StringIO()) as start:
        start(0)
        train.train_step(model, optimizer, torch.randint(0, 256, (2, 33)), rt, cfg)
        start(1)  # closes step 0's bar
    assert list(counted.values()) == [(passes, passes), (0, passes)]
    assert not any(block._forward_hooks or block._forward_pre_hooks for block in model.layers)


# ---------------------------------------------------------------------------------------------
# --keep-attention decided from the plan (on GPUs: tests/test_step_time.py, plan.plan_run)
# ---------------------------------------------------------------------------------------------

def test_keep_attention_flags_win_and_the_cpu_keeps_it_off():
    parse = lambda *flags: train.parse_args(["--stack", "3", *flags]).keep_attention  # noqa: E731
    assert (parse(), parse("--keep-attention"), parse("--no-keep-attention")) == (None, True, False)
    undecided = resolve_techniques(Config(model="llama3-8b", seq_len=2**17, stack=5,
                                          dtype="bfloat16", device="cpu"))
    assert planner.plan_run(undecided, None).settings == {}  # the CPU: no plan, nothing chosen
    run = train.train(train.parse_args(["--stack", "3", "--seq-len", "32", "--steps", "1",
                                        "--device", "cpu"]))
    assert run.model.kept_attention is None  # off on the CPU


# ---------------------------------------------------------------------------------------------
# The whole run through NCCL (GPU): what `torchrun --nproc-per-node 2 train.py --stack 5` does
# ---------------------------------------------------------------------------------------------

TRAINER_RUN = dict(model="tiny", seq_len=64, batch_size=2, steps=4, device="cuda",
                   warmup_steps=1, lr_schedule="cosine", grad_accum=2)


def _run_results(run, initial: dict) -> dict:
    """A run's losses, gradient norms and learning rates by step, and its parameters' whole
    updates (final - initial: the update, not the parameter, so that a step that never moves a
    weight fails). The gradient norms catch what Adam hides: a gradient scaled wrong (a sum for
    a mean, a missing 1/N of accumulation) moves the weights almost as the right one would."""
    results = {}
    for h in run.history:
        results.update({f"loss {h['step']}": h["loss"], f"grad_norm {h['step']}": h["grad_norm"],
                        f"lr {h['step']}": h["lr"]})
    return {**results, **parameter_updates(run.model, initial)}


def _initial_parameters() -> dict:
    """The tiny model's weights before step 0: drawn whole on the CPU from --seed, as every run
    of it draws them (train.build_model, exact_init)."""
    model = train.build_model(Config(model="tiny", device="cpu"), Runtime())
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _trainer_runs(folder, name, flags: dict):
    """train.train with `flags` on these ranks; rank 0 keeps the losses and updates."""
    import torch.distributed as dist

    cfg = resolve_techniques(Config(save_dir=f"{folder}/{name}", **TRAINER_RUN, **flags))
    results = _run_results(train.train(cfg), _initial_parameters())  # full(): every rank
    if dist.get_rank() == 0:
        torch.save(results, f"{folder}/{name}.pt")


def _one_process_runs(folder):
    """The fp32 reference (no technique) and the unsharded bf16 run: FSDP's mixed precision
    (fp32 weights, bf16 compute) on this one rank, nothing sharded."""
    _trainer_runs(folder, "reference", {"dtype": "float32"})
    _trainer_runs(folder, "unsharded", {"dtype": "bfloat16", "fsdp": True})


@pytest.mark.gpu
def test_gpu_the_trainer_through_nccl_matches_one_fp32_process(tmp_path):
    """train.train as torchrun runs it, on two NCCL ranks (on one GPU they share it) with the
    whole stack in bf16: the planner's choices for this GPU, the data, warm-up and a decay,
    accumulation, saves. Against one process in fp32 by the one bf16 rule (tests/reference.py)."""
    run_ranks(2, _trainer_runs, str(tmp_path), "nccl",
              {"stack": config.MAX_STACK, "dtype": "bfloat16", "save_every": 2}, backend="nccl")
    run_ranks(1, _one_process_runs, str(tmp_path), backend="nccl")
    got, reference, unsharded = (torch.load(tmp_path / f"{name}.pt")
                                 for name in ("nccl", "reference", "unsharded"))
    for results in (got, reference, unsharded):  # the schedule is the same numbers everywhere
        steps = range(TRAINER_RUN["steps"])
        assert [results.pop(f"lr {step}") for step in steps] == [
            config.learning_rate(resolve_techniques(Config(**TRAINER_RUN)), step)
            for step in steps]
    assert_within_bf16_error(got, unsharded, reference, "train.train, 2 NCCL ranks, --stack 5")
    assert [os.path.basename(p) for p in saved_state.complete_saves(str(tmp_path / "nccl"))] == [
        "step_00000002", "step_00000004"]
