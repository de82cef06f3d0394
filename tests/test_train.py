"""train.py: the README's default run works, flags compose, and bad input fails clearly."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ranks import run_ranks

from support.config import Config, MAX_STACK
from support.runtime import setup_runtime

train = importlib.import_module("train")
ROOT = Path(__file__).resolve().parents[1]


def run_script(*args, timeout=180):
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
])
def test_bad_flags_give_clear_errors(argv, needle, capsys):
    assert needle in error_of(argv, capsys)


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
