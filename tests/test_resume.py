"""Long runs that survive: resume is exact, saves are atomic, failures stop cleanly and clearly."""

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from reference import full
from test_train import ROOT

import model as llama
import resume

train = importlib.import_module("train")


def config(save_dir, steps, **extra):
    return train.resolve_techniques(train.Config(model="tiny", seq_len=32, steps=steps,
                                                 save_dir=str(save_dir), **extra))


def _resume_equals_straight(tmp, stack):
    straight = train.train(config(f"{tmp}/a", 6, stack=stack))
    train.train(config(f"{tmp}/b", 3, stack=stack))
    resumed = train.train(config(f"{tmp}/b", 6, stack=stack, resume=True))
    assert [h["step"] for h in resumed.history] == [3, 4, 5]
    assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history[3:]]
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(full(a), full(b)), name
    for a, b in zip(straight.optimizer.state.values(), resumed.optimizer.state.values()):
        assert torch.equal(full(a["exp_avg_sq"]), full(b["exp_avg_sq"]))


def test_six_steps_equal_three_plus_resume_three(tmp_path):
    """The whole stack at P=2: identical losses, parameters and Adam state."""
    run_ranks(2, _resume_equals_straight, str(tmp_path), train.MAX_STACK)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    train.train(config(tmp_path, 2, save_every=1))
    import torch.distributed.checkpoint as dcp

    def dies_midway(state, checkpoint_id):
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half a shard")
        raise KeyboardInterrupt  # the process is gone before the rename

    monkeypatch.setattr(dcp, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        train.train(config(tmp_path, 3, resume=True, save_every=1))
    monkeypatch.undo()
    assert (tmp_path / "step_00000003.tmp").exists()
    assert resume.complete_checkpoints(str(tmp_path))[-1].endswith("step_00000002")
    run = train.train(config(tmp_path, 4, resume=True))
    assert [h["step"] for h in run.history] == [2, 3]


def test_only_the_two_newest_checkpoints_are_kept(tmp_path):
    train.train(config(tmp_path, 4, save_every=1))
    assert [os.path.basename(p) for p in resume.complete_checkpoints(str(tmp_path))] == [
        "step_00000003", "step_00000004"]


def test_sigterm_saves_a_resumable_checkpoint(tmp_path):
    cmd = [sys.executable, "train.py", "--steps", "100000", "--seq-len", "64",
           "--save-dir", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(240, proc.kill)  # a silent, hung child fails the test, not CI
    watchdog.start()
    for line in proc.stdout:  # wait until training really runs
        if line.startswith("step    2"):
            break
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)  # a second signal (schedulers repeat them) must not kill the save
    stdout, stderr = proc.communicate(timeout=120)
    watchdog.cancel()
    assert proc.returncode == 0, stderr  # stopped cleanly, with a checkpoint to resume from
    assert "SIGTERM received: stopping after the current step" in stderr, stderr
    assert "stopped by SIGTERM" in stdout and "--save-dir" in stdout and stdout.rstrip().endswith("--resume"), stdout
    latest = resume.complete_checkpoints(str(tmp_path))[-1]
    saved_step = json.loads(Path(latest, "meta.json").read_text())["step"]
    assert saved_step >= 3
    resumed = subprocess.run(cmd[:2] + ["--steps", str(saved_step + 2)] + cmd[4:] + ["--resume"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at step {saved_step}" in resumed.stdout


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real = train.forward_backward
    calls = []

    def nan_at_step_3(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * float("nan") if len(calls) == 4 else loss

    monkeypatch.setattr(train, "forward_backward", nan_at_step_3)
    with pytest.raises(FloatingPointError, match=r"non-finite loss \(nan\).* at step 3"):
        train.train(config(tmp_path, 10, save_every=1))
    latest = resume.complete_checkpoints(str(tmp_path))[-1]
    assert latest.endswith("step_00000003")  # steps 0, 1, 2 done; nothing saved after the NaN


def test_resume_with_another_model_or_world_is_refused(tmp_path, capsys):
    train.train(config(tmp_path, 1))
    argv = ["--save-dir", str(tmp_path), "--seq-len", "32", "--resume", "--steps", "2"]
    with pytest.raises(SystemExit):
        train.main(argv + ["--model", "small"])
    assert "holds a model of another shape (tiny" in capsys.readouterr().err
    meta_path = Path(resume.complete_checkpoints(str(tmp_path))[-1], "meta.json")
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "world_size": 2}))
    with pytest.raises(SystemExit):
        train.main(argv)
    assert "was saved by 2 ranks with sp 1; this run has 1 ranks with sp 1" in capsys.readouterr().err


def test_resume_without_a_checkpoint_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--save-dir", str(tmp_path), "--resume"])
    assert "no complete checkpoint in" in capsys.readouterr().err


def test_out_of_memory_names_the_phase_and_the_next_technique(monkeypatch, capsys):
    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7680.00 GiB")

    monkeypatch.setattr(llama.Transformer, "forward", oom)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--steps", "1"])
    err = capsys.readouterr().err
    assert exit_info.value.code != 0
    assert "out of GPU memory in the forward: CUDA out of memory. Tried to allocate 7680.00 GiB" in err
    assert "next: try --fsdp" in err


def test_named_out_of_memory_is_still_torchs_and_named_once():
    """Code that catches torch.OutOfMemoryError (the benchmarks) catches the named one too, and
    an inner phase's name is not wrapped again by an outer one."""
    with pytest.raises(torch.OutOfMemoryError) as caught:
        with train.out_of_memory_names("step"):
            with train.out_of_memory_names("backward"):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    assert isinstance(caught.value, train.StepOutOfMemory)
    assert str(caught.value) == "out of GPU memory in the backward: CUDA out of memory. Tried to allocate 1.00 GiB"


def test_next_technique_follows_the_files():
    cfg = train.Config()
    assert train.next_memory_technique(cfg, 8).startswith("--fsdp")
    cfg = train.Config(fsdp=True, ulysses=True, checkpoint=True)
    assert train.next_memory_technique(cfg, 8).startswith("--offload")
    cfg = train.resolve_techniques(train.Config(stack=5, head_chunk=16))
    assert train.next_memory_technique(cfg, 8) == "a smaller --head-chunk (down to 8)"
    cfg = train.resolve_techniques(train.Config(stack=5))
    assert train.next_memory_technique(cfg, 8).startswith("fewer tokens per GPU")
