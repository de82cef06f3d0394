"""bench/peers on the CPU: the runner's rows, ratios and loss check with the tiny model (fp32).
ALST only where DeepSpeed is importable (never in CI: it is no requirement of the project)."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.peers import run
from bench.peers.common import parse_spec


def test_specs_parse_and_refuse():
    assert parse_spec("ours:5@cudnn+offload").__dict__ == {
        "text": "ours:5@cudnn+offload", "name": "ours", "level": 5, "variant": "cudnn",
        "offload": True}
    assert parse_spec("alst").variant == "liger" and parse_spec("hf").variant == "bf16"
    for bad in ("ours", "alst:3", "hf+offload", "hf@fp16", "ring:5"):
        with pytest.raises(ValueError):
            parse_spec(bad)


def test_rows_and_ratios_on_cpu(tmp_path):
    out = tmp_path / "peers.json"
    run.main(["--stacks", "ours:4", "hf", "--model", "tiny", "--seq-lens", "256", "--steps", "2",
              "--device", "cpu", "--profile", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["stack"], r["seq_len"]): r for r in result["rows"]}
    for stack in ("ours:4", "hf"):
        row = rows[(stack, 256)]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and len(row["step_times_s"]) == 2
        # --profile: one more step profiled, its ops' own times in the row
        assert row["profile"]["profile_top_ops"][0]["own_ms"] > 0
        assert 5.0 < row["losses"][0] < 6.0  # ln(256) = 5.55 from a random init
    assert result["stack_info"]["ours:4"]["stack"] == "train.py --stack 4"
    assert [(r["ours"], r["peer"]) for r in result["ratios"]] == [("ours:4", "hf")]
    assert result["longest_ok"] == {"ours:4": 256, "hf": 256}


def processes_running(*args: str) -> list[int]:
    """Pids of this machine's processes whose command line holds every one of args."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or it just ended
            continue
        if all(arg.encode() in argv for arg in args):
            pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads processes from /proc (Linux)")
def test_a_stopped_runner_takes_its_stack_process_with_it(tmp_path):
    """`timeout` stops the runner with SIGTERM. Each stack's process runs in its own session, which
    the signal does not reach: it must end with the runner, not keep the GPU and its pinned host
    memory from the next run (seen on the GPU machine: a DeepSpeed process outlived a runner
    stopped this way, and train.py's host check refused the next run). The runner is stopped
    while its stack is inside a step that takes many seconds on a CPU (32K tokens) and prints
    nothing: such a process ends at its next print (a closed pipe) at the earliest, so one
    still there 0.5 s after the runner ended outlived it."""
    seed = str(900_000 + os.getpid() % 10_000)  # marks this test's stack process
    runner = subprocess.Popen(
        [sys.executable, "-m", "bench.peers.run", "--stacks", "ours:4", "--model", "tiny",
         "--seq-lens", "32K", "--steps", "2", "--device", "cpu", "--seed", seed,
         "--budget-s", "600", "--out", str(tmp_path / "peers.json")],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    output = []
    for line in runner.stdout:  # ends early only if the runner does
        output.append(line)
        if "built in" in line:  # its first step begins
            break
    try:
        assert processes_running("--child", "ours:4", seed), "".join(output[-20:])
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        deadline = time.time() + 0.5  # a killed and reaped child is gone at once
        while processes_running("--child", "ours:4", seed) and time.time() < deadline:
            time.sleep(0.2)
        assert not processes_running("--child", "ours:4", seed), "the stack outlived its runner"
        assert runner.returncode == 128 + signal.SIGTERM
    finally:  # a failed check leaves no process behind either
        runner.kill()
        for pid in processes_running("--child", "ours:4", seed):
            os.kill(pid, signal.SIGKILL)


def test_loss_check_same_weights_same_losses(tmp_path):
    """From one exported folder ours and transformers compute the same losses in fp32, before
    and after one AdamW step; the control (another seed) is much further away."""
    out = tmp_path / "check.json"
    run.main(["--check-loss", "256", "--stacks", "ours:4", "hf", "--model", "tiny",
              "--device", "cpu", "--check-dir", str(tmp_path / "weights"), "--out", str(out)])
    check = json.loads(out.read_text())["loss_check"]
    assert check["reference"]["status"] == "ok"
    assert check["stacks"]["ours:4"]["status"] == "ok" and check["stacks"]["hf"]["status"] == "ok"
    hf = check["differences"]["hf"]
    assert abs(hf["first_loss_minus_ours"]) < 1e-4
    assert abs(hf["second_loss_minus_ours"]) < 1e-3
    assert abs(check["differences"]["ours:4"]["first_loss_minus_reference"]) < 1e-4
    assert check["control_distance"] > 10 * abs(hf["first_loss_minus_ours"])


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is a benchmark dependency only (bench/peers/__init__.py)")
def test_alst_on_cpu(tmp_path):
    out = tmp_path / "alst.json"
    run.main(["--stacks", "alst", "--model", "tiny", "--seq-lens", "256", "--steps", "2",
              "--device", "cpu", "--out", str(out)])
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "ok", row


def test_a_row_cut_short_keeps_its_completed_steps(tmp_path):
    """The child writes each step as it ends; a row the deadline stopped keeps those steps."""
    rows_file = tmp_path / "rows.jsonl"
    emit = run.rows_writer(str(rows_file))
    emit({"step": {"seq_len": 256, "time_s": 1.5, "peak_gib": 2.0, "loss": 5.5}})
    emit({"row": {"stack": "hf", "seq_len": 256, "status": "ok"}})
    emit({"step": {"seq_len": 512, "time_s": 3.0, "peak_gib": 4.0, "loss": 5.4}})
    steps = run.completed_steps(str(rows_file))
    assert steps[512] == [{"time_s": 3.0, "peak_gib": 4.0, "loss": 5.4}]
    assert steps[256] == [{"time_s": 1.5, "peak_gib": 2.0, "loss": 5.5}] and 1024 not in steps
