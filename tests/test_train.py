"""train.py: the README's default run works, flags compose, and bad input fails clearly."""

import importlib
import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from ranks import run_ranks
from reference import (assert_matches, make_batch, reference_loss_and_grads,
                       train_loss_and_grads)
from test_packed import write_token_file  # the tests' one writer of token files
from torch.utils._python_dispatch import TorchDispatchMode

import model as llama
from base import kernels
from support.config import Config, MAX_STACK, model_args
from support.data import TokenData
from support.runtime import setup_runtime

train = importlib.import_module("train")
ROOT = Path(__file__).resolve().parents[1]


def run_script(*args, timeout=240):
    """python ARGS in a fresh process from the repository root (one thread: the busy CI)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def read_log(path):
    lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return lines[0], lines[1:]


@pytest.mark.slow
def test_default_run_exits_0_and_loss_goes_down(tmp_path):
    result = run_script("train.py", "--log-file", str(tmp_path / "log.jsonl"))
    assert result.returncode == 0, result.stderr
    header, steps = read_log(tmp_path / "log.jsonl")
    assert header["config"]["model"] == "tiny" and header["world_size"] == 1
    assert header["torch"] == torch.__version__ and header["attention_kernel"]
    assert len(steps) == Config().steps
    assert ({"step", "loss", "tokens_per_s_per_gpu", "peak_gpu_mem_gib", "step_time_s"}
            <= steps[0].keys())
    first, last = [sum(s["loss"] for s in part) / 10 for part in (steps[:10], steps[-10:])]
    assert last < first - 0.5, (first, last)


@pytest.mark.slow
def test_torchrun_two_processes_with_the_stack(tmp_path):
    """The README's multi-process command, on CPU/gloo, with every technique."""
    result = run_script("-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py",
                        "--stack", str(MAX_STACK), "--steps", "3", "--seq-len", "64",
                        "--log-file", str(tmp_path / "log.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    header, steps = read_log(tmp_path / "log.jsonl")
    assert header["world_size"] == 2 and header["sp"] == 2 and len(steps) == 3


def error_of(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train.main(argv)
    assert exit_info.value.code != 0
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["--stack", "6"], "--stack must be between 0 and 5"),
    (["--model", "llama5"], "unknown model preset 'llama5'"),
    (["--seq-len", "lots"], "cannot read a token count from 'lots'"),
    (["--ulysses", "--sp", "3"], "--sp (3) must divide the number of ranks (1)"),
    (["--sp", "2"], "--sp needs --ulysses or --untied"),
    (["--ulysses", "--untied"], "alternatives for the same seam"),
    # issue 17: once read silently as something else, now refused
    (["--seq-len", "100.7"], "a token count must be a whole, finite number, got '100.7'"),
    (["--seq-len", "inf"], "a token count must be a whole, finite number, got 'inf'"),
    (["--seq-len", "1e12"], "more than 2,147,483,648 tokens"),
    (["--ulysses", "--sp", "0"], "--sp must be at least 1, got 0"),
    (["--grad-clip", "-1"],
     "--grad-clip must be a finite number >= 0, got -1.0 (0 turns clipping off)"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--warmup-steps", "-1"], "--warmup-steps must be at least 0, got -1"),
    (["--plan", "--gpu-mem", "infGiB"], "a memory size must be positive and finite, got 'infGiB'"),
    (["--checkpoint-layers", "1"], "--checkpoint-layers is a setting of --checkpoint (03)"),
    (["--checkpoint", "--checkpoint-layers", "0"], "--checkpoint-layers must be at least 1"),
    (["--offload", "--checkpoint-layers", "3"],
     "--checkpoint-layers 3 is more than the model's 2 layers"),
    # once silently resolved to something else (the sweep of session 25)
    (["--stack", "5", "--ulysses"], "--stack 5 runs 05's Untied Ulysses in 02's place"),
    (["--stack", "2", "--ulysses", "--untied"], "alternatives for the same seam"),
    (["--mlp-tile-tokens", "16"], "--mlp-tile-tokens is a setting of --tile-mlp"),
    (["--loss-tile-tokens", "16"], "--loss-tile-tokens is a setting of --tile-loss"),
    (["--stack", "4", "--mlp-tile-tokens", "0"],
     "--mlp-tile-tokens must be a positive whole number of tokens, got 0"),
    (["--stack", "4", "--loss-tile-tokens", "-2"],
     "--loss-tile-tokens must be a positive whole number of tokens, got -2"),
    (["--model", ""], "unknown model preset ''"),
    (["--rope-theta", "0"], "--rope-theta must be a finite number > 0"),
    (["--rope-scaling", "yarn", "--rope-factor", "2", "--rope-original-context", "-5"],
     "--rope-original-context must be at least 1 token, got -5"),
    (["--seed", "-1"], "--seed must be a whole number from 0 to 2^32 - 1, got -1"),
    (["--seed", str(10**14)], "--seed must be a whole number from 0 to 2^32 - 1"),
    (["--steps", str(10**23)], "--steps must be at most 2,147,483,648"),  # tqdm's C long
    (["--seq-len", "64", "--grad-accum", str(10**11)], "x --grad-accum 100000000000 is more "
     "than 2,147,483,648 tokens a step"),  # (it built the step's window: a hang)
    # settings that another flag's value made no-ops, taken silently (the sweep of session 34)
    (["--rope-scaling", "none", "--rope-factor", "4", "--seq-len", "32", "--steps", "1"],
     "--rope-factor: settings of --rope-scaling llama3 or yarn, and this model's rotary scaling "
     "is none"),
    (["--min-lr", "1e-4", "--seq-len", "32", "--steps", "1"],
     "--min-lr is where --lr-schedule cosine or linear ends; the schedule is constant"),
    # the first value each check refuses: one past its bound, or infinite where only a finite
    # number works (the same sweep)
    (["--stack", "-1"], "--stack must be between 0 and 5, got -1"),  # not plain training
    (["--head-chunk", "4"], "--head-chunk is a setting of --untied (05)"),  # not ignored
    (["--seed", str(2**32)], "--seed must be a whole number from 0 to 2^32 - 1, got 4294967296"),
    (["--seq-len", "4096M"], "more than 2,147,483,648 tokens (2^31: positions are 32-bit"),
    (["--rope-theta", "inf"], "--rope-theta must be a finite number > 0 (the rotary base), "
                              "got inf"),
    (["--rope-factor", "inf"], "--rope-factor must be a finite number >= 1"),
    (["--rope-scaling", "yarn", "--rope-factor", "2", "--rope-original-context", "0"],
     "--rope-original-context must be at least 1 token, got 0"),
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--weight-decay", "inf"], "--weight-decay must be a finite number >= 0, got inf"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
])
def test_bad_flags_give_clear_errors(argv, needle, capsys, monkeypatch):
    """Each refused before the run reads its data: a check that regresses fails here at once,
    rather than running the step it let through (an hour of --steps, a window of 10^11 tokens)."""
    def accepted(*args, **kwargs):
        raise AssertionError(f"{argv} was accepted: the run went on to read its data")

    monkeypatch.setattr(train, "TokenData", accepted)
    assert needle in error_of(argv, capsys)


def test_a_stretch_of_a_model_without_rotary_scaling_is_refused():
    """Qwen3's presets scale no rotary frequencies: a --rope-factor or --rope-original-context
    given for one is refused, not ignored (read at the flags: no model is built)."""
    for flag, value in (("--rope-factor", "4"), ("--rope-original-context", "4096")):
        with pytest.raises(ValueError, match=f"{flag}: settings of --rope-scaling llama3 or yarn"):
            train.parse_args(["--model", "qwen3-0.6b", flag, value])
    assert train.parse_args(["--model", "qwen3-0.6b", "--rope-scaling", "yarn",
                             "--rope-factor", "4"]).rope_factor == 4


def test_cuda_named_where_there_is_none_is_refused(monkeypatch, capsys):
    """--device cuda on a machine without CUDA: said at the flags, not a traceback later."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "--device cuda, but CUDA is not available here" in error_of(["--device", "cuda"],
                                                                       capsys)


def test_a_gpu_run_defaults_to_bfloat16_and_to_stack_auto(monkeypatch):
    """--device cuda (CUDA reported present; nothing is built): the dtype defaults to bfloat16
    and, with no technique flag, the techniques to --stack auto; a --dtype or a technique flag
    given (--stack 0 too) is kept. The CPU's defaults: float32, no plan."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = train.parse_args(["--device", "cuda"])
    assert (cfg.dtype, cfg.stack) == ("bfloat16", "auto")
    given = train.parse_args(["--device", "cuda", "--dtype", "float32", "--stack", "0"])
    assert (given.dtype, given.stack) == ("float32", 0)
    assert train.parse_args(["--device", "cuda", "--fsdp"]).stack is None
    cpu = train.parse_args(["--device", "cpu"])
    assert (cpu.dtype, cpu.stack) == ("float32", None)


@pytest.mark.parametrize("content,needle", [
    (None, "does not exist"),
    (b"", "is empty"),
    (b"\x01\x00\x02", "not a whole number of uint16 tokens"),
    (b"\x01\x00" * 10, "holds 10 tokens, fewer than one sequence needs (65"),
    (b"\xff\xff" * 100, "holds token id 65535 at position 0, but the model's vocabulary has 256"),
    # uint32 ids read as uint16: (id, 0, id, 0, ...), all inside the vocabulary
    ((torch.arange(200) % 255 + 1).to(torch.int32).numpy().tobytes(), "looks like uint32 ids"),
    # an id out of the vocabulary in the fifth window: found at start, not at step 4
    (b"\x01\x00" * 65 * 4 + b"\x00\x01" + b"\x01\x00" * 64, "holds token id 256 at position 260"),
])
def test_bad_data_files_give_clear_errors(tmp_path, content, needle, capsys):
    path = tmp_path / "tokens.bin"
    if content is not None:
        path.write_bytes(content)
    assert needle in error_of(["--data", str(path), "--seq-len", "64", "--steps", "1"], capsys)


def test_a_directory_as_data_is_named_a_directory(tmp_path, capsys):
    assert (f"data file {str(tmp_path)!r} is a directory"
            in error_of(["--data", str(tmp_path)], capsys))


def test_the_data_sidecar_records_dtype_and_vocabulary(tmp_path, capsys):
    path = tmp_path / "tokens.bin"
    path.write_bytes((torch.arange(1000) % 255 + 1).to(torch.int32).numpy().tobytes())
    sidecar = tmp_path / "tokens.bin.json"
    sidecar.write_text(json.dumps({"dtype": "uint32", "vocab_size": 256}))
    argv = ["--data", str(path), "--seq-len", "64", "--steps", "1"]
    assert len(train.train(train.parse_args(argv)).history) == 1  # uint32 without --data-dtype
    assert "--data-dtype uint16, but" in error_of(argv + ["--data-dtype", "uint16"], capsys)
    sidecar.write_text(json.dumps({"dtype": "uint32", "vocab_size": 128256}))
    assert "was tokenized with a vocabulary of 128256 ids" in error_of(argv, capsys)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.int32])
def test_training_from_a_token_file(tmp_path, dtype):
    path = tmp_path / "tokens.bin"
    tokens = (torch.arange(1000) * 7 % 256).to(dtype)
    path.write_bytes(tokens.numpy().tobytes() if dtype == torch.int32 else
                     tokens.view(torch.int16).numpy().tobytes())
    name = "uint16" if dtype == torch.uint16 else "uint32"
    history = train.train(train.parse_args(["--data", str(path), "--data-dtype", name,
                                            "--seq-len", "64", "--steps", "2"])).history
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in history)


def test_warmup_scales_the_first_steps_learning_rate():
    """Step k of --warmup-steps W moves the weights as --lr x (k + 1) / W would; from W on, --lr."""
    def weights(*flags):
        run = train.train(train.parse_args(["--seq-len", "32", *flags]))
        return run, torch.cat([p.detach().flatten() for p in run.model.parameters()])

    warm, warm_weights = weights("--lr", "4e-3", "--warmup-steps", "4", "--steps", "1")
    _, plain_weights = weights("--lr", "1e-3", "--steps", "1")
    _, full_weights = weights("--lr", "4e-3", "--steps", "1")
    assert torch.equal(warm_weights, plain_weights)
    assert not torch.allclose(warm_weights, full_weights)  # the warmup did act
    assert warm.optimizer.param_groups[0]["lr"] == 1e-3
    later, _ = weights("--lr", "4e-3", "--warmup-steps", "4", "--steps", "6")
    assert later.optimizer.param_groups[0]["lr"] == 4e-3


def _several_processes_need_fsdp():
    with pytest.raises(ValueError, match="2 processes need --fsdp"):
        setup_runtime(Config(model="tiny"))


def test_several_processes_without_fsdp_are_refused():
    run_ranks(2, _several_processes_need_fsdp)


# ---------------------------------------------------------------------------------------------
# --seed: the initial weights and the synthetic data follow it, on any layout of ranks
# ---------------------------------------------------------------------------------------------

SEEDED = ["--seq-len", "32", "--batch-size", "2"]


def _weights_and_batches(seed: int):
    """The weights train.py builds with --seed `seed`, and its synthetic batches of steps 0-2."""
    cfg = train.parse_args([*SEEDED, "--seed", str(seed)])
    model = train.build_model(cfg, setup_runtime(cfg))
    data = TokenData(cfg, model.args.vocab_size, 0, 1)
    return model.state_dict(), torch.stack([data.batch(step) for step in range(3)])


def test_the_seed_draws_the_weights_and_the_synthetic_batches():
    """--seed 7: the weights are model.init_weights' draws from 7 and the batches synthetic
    progressions (start + stride x position, modulo the vocabulary), both other than seed 0's;
    the same seed gives the same weights and batches again."""
    weights, batches = _weights_and_batches(7)
    again_weights, again_batches = _weights_and_batches(7)
    seed_0_weights, seed_0_batches = _weights_and_batches(0)
    reference = llama.Transformer(llama.get_model_args("tiny"))
    llama.init_weights(reference, seed=7)
    for name, want in reference.state_dict().items():
        assert torch.equal(weights[name], want) and torch.equal(again_weights[name], want), name
    drawn = [name for name in weights if not llama.is_norm(name)]  # norms start at 1 for any seed
    assert all(not torch.equal(weights[name], seed_0_weights[name]) for name in drawn)
    assert torch.equal(batches, again_batches) and not torch.equal(batches, seed_0_batches)
    vocab = reference.args.vocab_size
    stride = (batches[..., 1] - batches[..., 0]) % vocab  # each row: one start, one stride
    positions = torch.arange(batches.shape[-1])
    assert torch.equal(batches, (batches[..., :1] + stride[..., None] * positions) % vocab)
    assert ((1 <= stride) & (stride <= 16)).all()


def test_the_synthetic_global_batch_does_not_depend_on_the_layout():
    """Step 1 of --seed 7 as 2 data-parallel ranks of 1 row and as 1 process of 2 rows: the
    same global samples (data.py's `first`, 'global sample index'), as a token file gives."""
    cfg = train.parse_args(["--seq-len", "8", "--seed", "7"])
    one_process = TokenData(replace(cfg, batch_size=2), 256, 0, 1).batch(1)
    two_ranks = torch.cat([TokenData(cfg, 256, rank, 2).batch(1) for rank in (0, 1)])
    assert torch.equal(two_ranks, one_process)


def test_a_token_file_gives_each_data_parallel_rank_its_own_windows(tmp_path):
    """2 data-parallel ranks of 2 rows, steps 0-2, over a file of 20 windows of seq_len + 1
    distinct ids: step s, rank r reads windows 4s + 2r and 4s + 2r + 1, consecutive in the file;
    no window twice, the global batch of 1 process of 4 rows; past the 20th window, the first."""
    window = 9
    stream = torch.arange(20 * window) % 255 + 1
    path = write_token_file(tmp_path / "tokens.bin", stream)
    cfg = replace(train.parse_args(["--data", path, "--seq-len", "8"]), batch_size=2)
    windows = stream.view(20, window)
    for step in range(3):
        for rank in (0, 1):
            first = 4 * step + 2 * rank
            got = TokenData(cfg, 256, rank, 2).batch(step)
            assert torch.equal(got, windows[first:first + 2]), (step, rank)
        one_process = TokenData(replace(cfg, batch_size=4), 256, 0, 1).batch(step)
        assert torch.equal(one_process, windows[4 * step:4 * step + 4]), step
    # past the file's end the windows start over from its first (an epoch), not its last
    wrapped = TokenData(replace(cfg, batch_size=4), 256, 0, 1).batch(5)  # windows 20-23
    assert torch.equal(wrapped, windows[0:4])
    rank_1 = TokenData(cfg, 256, 1, 2).batch(4)  # windows 18, 19: the last two
    assert torch.equal(rank_1, windows[18:20])
    assert torch.equal(TokenData(cfg, 256, 0, 2).batch(5), windows[0:2])  # 20, 21: 0, 1


def test_a_sidecar_counting_other_tokens_is_refused(tmp_path, capsys):
    """The sidecar's token count is not the file's (a truncated copy, another file's sidecar):
    refused before training, naming both."""
    path = tmp_path / "tokens.bin"
    write_token_file(path, torch.arange(1000) % 255 + 1, sidecar={"dtype": "uint16",
                                                                  "tokens": 999})
    assert ("says 999 tokens, but" in error_of(["--data", str(path), "--seq-len", "64",
                                                 "--steps", "1"], capsys))


def _seeded_steps_equal_one_process(seed: int):
    """Step 0 of --seed `seed` under FSDP (dp 2) and under --stack 5 --sp 2 (05's sequence
    shards, FSDP; dp 1) equals the plain model drawn from `seed` in one process, on the same
    global batch: every data-parallel rank's synthetic rows, as train.py draws them."""
    for flags in (["--fsdp"], ["--stack", "5", "--sp", "2"]):
        cfg = train.parse_args([*SEEDED, "--seed", str(seed), *flags])
        rt = setup_runtime(cfg)
        vocab = model_args(cfg).vocab_size
        tokens = torch.cat([TokenData(cfg, vocab, rank, rt.dp).batch(0) for rank in range(rt.dp)])
        labels = tokens[:, 1:]
        loss, grads = train_loss_and_grads(cfg, tokens, labels, rt)
        ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels, seed=seed)
        assert_matches(loss, grads, ref_loss, ref_grads, what=f"--seed {seed} {' '.join(flags)}")


def test_a_seeded_run_on_two_ranks_equals_one_process():
    run_ranks(2, _seeded_steps_equal_one_process, 7)


# ---------------------------------------------------------------------------------------------
# --data-dtype uint32: the same tokens as uint16, and ids above 65,535 kept
# ---------------------------------------------------------------------------------------------

def test_a_uint32_token_file_gives_the_batches_and_losses_of_uint16(tmp_path):
    """The same ids written as uint16 and as uint32 (--data-dtype each): the same batches, the
    file's windows of seq_len + 1 ids in order, and so the same losses, bit for bit."""
    ids = (np.arange(1000) * 7 + 3) % 256
    seq_len, rows, steps = 32, 2, 3
    windows = ids[:len(ids) // (seq_len + 1) * (seq_len + 1)].reshape(-1, seq_len + 1)
    losses = {}
    for dtype in ("uint16", "uint32"):
        token_file = write_token_file(tmp_path / f"{dtype}.bin", ids, dtype=dtype)
        cfg = train.parse_args(["--data", token_file,
                                "--data-dtype", dtype, "--seq-len", str(seq_len),
                                "--batch-size", str(rows), "--steps", str(steps)])
        data = TokenData(cfg, 256, 0, 1)
        for step in range(steps):
            want = windows[[(step * rows + row) % len(windows) for row in range(rows)]]
            assert torch.equal(data.batch(step), torch.from_numpy(want)), (dtype, step)
        losses[dtype] = [record["loss"] for record in train.train(cfg).history]
    assert losses["uint32"] == losses["uint16"]


def test_a_uint32_token_id_above_65535_reaches_the_model(tmp_path, monkeypatch):
    """A vocabulary beyond uint16's (the tiny model with 70,000 ids): ids 65,535 to 69,999 come
    back as written, not wrapped modulo 2^16, and the run's first loss is the plain model's loss
    on them. (Read as uint16 they would be other ids, all inside this vocabulary: no error.)"""
    vocab, seq_len = 70_000, 32
    monkeypatch.setitem(llama.PRESETS, "tiny-vocab-70k",
                        replace(llama.get_model_args("tiny"), vocab_size=vocab))
    ids = np.array([65_535, 65_536, 69_999, 1, 2**16 + 7, 0] * 11)  # 66 ids: two windows
    token_file = write_token_file(tmp_path / "tokens.bin", ids, dtype="uint32")
    cfg = train.parse_args(["--model", "tiny-vocab-70k", "--data-dtype", "uint32",
                            "--data", token_file, "--seq-len", str(seq_len), "--steps", "1"])
    tokens = TokenData(cfg, vocab, 0, 1).batch(0)
    assert torch.equal(tokens, torch.from_numpy(ids[:seq_len + 1])[None])
    ref_loss, _ = reference_loss_and_grads("tiny-vocab-70k", tokens, tokens[:, 1:])
    assert train.train(cfg).history[0]["loss"] == pytest.approx(float(ref_loss), rel=1e-6)


def test_a_uint16_file_read_as_uint32_is_refused(tmp_path, capsys):
    """--data-dtype uint32 on a uint16 file: two ids read as one, far outside the vocabulary, or
    a byte count that is no whole number of uint32 ids: refused, naming --data-dtype."""
    ids = (np.arange(200) * 7 + 1) % 256
    flags = ["--data-dtype", "uint32", "--seq-len", "32", "--steps", "1"]
    even = write_token_file(tmp_path / "even.bin", ids, dtype="uint16")
    err = error_of(["--data", even, *flags], capsys)
    assert f"holds token id {ids[0] + (ids[1] << 16)} at position 0" in err, err
    assert "is --data-dtype uint32 right?" in err, err
    odd = write_token_file(tmp_path / "odd.bin", ids[:-1], dtype="uint16")
    assert ("not a whole number of uint32 tokens (4 bytes each); is --data-dtype right?"
            in error_of(["--data", odd, *flags], capsys))


# ---------------------------------------------------------------------------------------------
# --attn-kernel on the CPU
# ---------------------------------------------------------------------------------------------

CPU_FLASH = "_scaled_dot_product_flash_attention_for_cpu"  # SDPA's fused CPU kernel (ATen op)


class AtenOps(TorchDispatchMode):
    """The names of the ATen ops run inside it: which attention kernel really ran."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def restore_kernel():
    """setup_runtime makes --attn-kernel the whole process's kernel: auto again afterwards."""
    yield
    kernels.use_kernel("auto")


@pytest.mark.parametrize("flags", [[], ["--untied"]])
def test_the_math_kernel_trains_like_the_default_cpu_kernel(flags, restore_kernel):
    """--attn-kernel math and the default (auto: SDPA's CPU kernel) each equal the plain model,
    fp32: at seam 1, and under 05 (one rank), whose stages run the forward and the backward apart
    from the log-sum-exp: there math is kernels.math_attention_forward/backward and the CPU
    kernel never runs (auto runs it). Seam 1 on the CPU: the test below.)"""
    tokens, labels = make_batch(256, 2, 32, ignore_frac=0.2)
    ref_loss, ref_grads = reference_loss_and_grads("tiny", tokens, labels)
    for kernel in ("auto", "math"):
        cfg = train.parse_args(["--seq-len", "32", "--batch-size", "2", "--attn-kernel", kernel,
                                *flags])
        with AtenOps() as ops:
            loss, grads = train_loss_and_grads(cfg, tokens, labels)
        assert_matches(loss, grads, ref_loss, ref_grads, what=f"--attn-kernel {kernel} {flags}")
        if flags:
            assert (CPU_FLASH in ops.names) == (kernel == "auto"), (kernel, ops.names)


def test_the_math_kernel_is_what_runs_at_seam_1_on_the_cpu(restore_kernel):
    """--attn-kernel math is the plain formula (base/kernels.py); on a GPU seam 1 forces SDPA's
    math backend for it, so on the CPU the fused CPU kernel must not run either."""
    tokens, labels = make_batch(256, 1, 32)
    cfg = train.parse_args(["--seq-len", "32", "--attn-kernel", "math"])
    with AtenOps() as ops:
        train_loss_and_grads(cfg, tokens, labels)
    assert kernels.attention_kernel_name(torch.device("cpu"), torch.float32) == "math"
    assert CPU_FLASH not in ops.names, "the run log says math; SDPA's CPU kernel ran"


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_a_gpu_kernel_named_on_the_cpu_runs_the_cpu_kernel_and_says_so(kernel, restore_kernel,
                                                                      capsys):
    """A GPU-only kernel named on a CPU run (kernels.lse_kernel keeps CPU tensors on their own
    kernel): the default's losses bit for bit, and the header names the kernel that ran."""
    argv = ["--seq-len", "32", "--steps", "2"]
    default = [record["loss"] for record in train.train(train.parse_args(argv)).history]
    capsys.readouterr()
    named = train.train(train.parse_args(argv + ["--attn-kernel", kernel])).history
    assert [record["loss"] for record in named] == default
    assert "attention: CPU (SDPA)" in capsys.readouterr().out.splitlines()[0]


def test_an_unknown_attention_kernel_is_refused_naming_the_choices(restore_kernel, capsys):
    err = error_of(["--attn-kernel", "bogus"], capsys)
    assert "argument --attn-kernel: invalid choice: 'bogus'" in err, err
    assert all(name in err.split("invalid choice")[1] for name in kernels.KERNELS), err
    # A Config made in code skips argparse: setup_runtime refuses it the same way.
    with pytest.raises(ValueError, match=re.escape(
            f"--attn-kernel must be one of {', '.join(kernels.KERNELS)}, got 'bogus'")):
        setup_runtime(Config(attn_kernel="bogus"))
    if not kernels.fa4_installed():  # a GPU kernel that is not there: said, not a traceback
        assert ("--attn-kernel fa4: FlashAttention-4 is not installed"
                in error_of(["--attn-kernel", "fa4", "--seq-len", "32", "--steps", "1"], capsys))


def test_a_cpu_run_whose_model_state_cannot_fit_is_refused_before_it_builds(capsys, monkeypatch,
                                                                            tmp_path):
    """Nothing is planned on the CPU, but Llama-3-8B's model state (119.7 GiB) on a host that
    has less is refused in words before the model is built or an output written."""
    from support import host_memory

    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 8 * 2**30)
    built = []
    monkeypatch.setattr(train, "build_model", lambda *a: built.append(1))
    log = tmp_path / "log.txt"
    cpu_8b = ["--device", "cpu", "--model", "llama3-8b", "--seq-len", "3M"]
    error = error_of([*cpu_8b, "--log-file", str(log)], capsys)
    assert "a CPU run of llama3-8b keeps its model state in this host's memory: at least " \
           "119.7 GiB" in error and "16 bytes a parameter" in error
    assert "8.0 GiB is available" in error and not built and not log.exists()
    # in bf16 without FSDP the whole model is bf16: 8 bytes a parameter (59.8 GiB)
    assert "at least 59.8 GiB" in error_of([*cpu_8b, "--dtype", "bfloat16"], capsys)
    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 2**40)  # it fits: trains
    monkeypatch.setattr(train, "build_model", lambda *a: (_ for _ in ()).throw(ValueError("built")))
    assert "built" in error_of(cpu_8b, capsys)


def test_a_sharded_cpu_run_needs_only_this_hosts_ranks_share(monkeypatch):
    """A CPU run of 4 ranks, 2 of them on this host, keeps half the sharded model state here:
    16 bytes a parameter x 2^30 parameters x 2 / 4 ranks = 8 GiB."""
    from support import host_memory

    monkeypatch.setattr(host_memory, "available_host_memory", lambda: 2**30)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=r"at least 8\.0 GiB"):
        host_memory.check_cpu_run_fits("m", 2**30, sharded=True, dtype="float32")


def test_host_adamw_takes_this_ranks_share_of_the_cores(monkeypatch):
    """--offload-model-state steps AdamW on the host: 2 ranks on a host of 16 cores take 8
    threads each (not torchrun's one, nor all 16)."""
    from support import host_memory

    threads = []
    monkeypatch.setattr(host_memory.os, "sched_getaffinity", lambda pid: set(range(16)),
                        raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    host_memory.use_this_ranks_cores()
    assert threads == [8]


def test_available_host_memory_is_memavailable_or_the_cgroups_room(monkeypatch):
    """MemAvailable counts KiB; under a cgroup v2 limit what is left of it (limit less current)
    where that is less; "max" is no limit."""
    from support import host_memory

    files = {"/proc/meminfo": "MemTotal: 2048 kB\nMemAvailable: 1000 kB\n",
             "/sys/fs/cgroup/memory.max": "800000\n",
             "/sys/fs/cgroup/memory.current": "300000\n"}
    monkeypatch.setattr(host_memory, "open", lambda path: io.StringIO(files[path]),
                        raising=False)
    assert host_memory.available_host_memory() == 500_000
    files["/sys/fs/cgroup/memory.max"] = "max\n"
    assert host_memory.available_host_memory() == 1000 * 1024
