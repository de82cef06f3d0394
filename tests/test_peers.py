"""bench/peers on the CPU: the runner's rows, ratios and loss check with the tiny model (fp32).
ALST only where DeepSpeed is importable (never in CI: it is no requirement of the project)."""

import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.peers import run
from bench.peers.common import BEST, parse_choice, parse_spec


def test_alst_offload_refuses_a_host_too_small_as_out_of_memory(monkeypatch):
    """ZeRO's offload of Llama-3-8B needs 134.6 GiB of host memory: on a 128 GiB host the row is
    out of memory before DeepSpeed is imported (a fit, which a choice 'A|B' records as one), not
    a process the kernel kills minutes in."""
    from bench.peers import alst

    monkeypatch.setattr(alst, "available_host_memory", lambda: 128 * 2**30)
    with pytest.raises(MemoryError) as refused:
        alst.check_host_fits_offload("llama3-8b")
    assert run.failure_status(refused.value).startswith("OOM: out of memory on the host")
    assert "134.6 GiB for llama3-8b" in str(refused.value), refused.value
    alst.check_host_fits_offload("llama3.2-3b")  # 53.9 GiB (18 x 3.21B): fits
    monkeypatch.setattr(alst, "available_host_memory", lambda: None)  # unknown: not refused
    alst.check_host_fits_offload("llama3-8b")


def test_specs_parse_and_refuse():
    assert parse_spec("ours:5@cudnn+offload").__dict__ == {
        "text": "ours:5@cudnn+offload", "name": "ours", "level": 5, "variant": "cudnn",
        "offload": True, "checkpoint": True, "overlap_optimizer": None, "offload_moments": False}
    assert parse_spec("ours:auto+overlap").overlap_optimizer is True
    moments = parse_spec("ours:auto+moments")
    assert moments.offload_moments and moments.overlap_optimizer is True
    assert parse_spec("ours:auto+nooverlap").overlap_optimizer is False
    assert parse_spec("alst").variant == "liger" and parse_spec("hf").variant == "bf16"
    assert parse_spec("ours:auto").level == "auto" and not parse_spec("hf+nockpt").checkpoint
    assert [s.text for s in parse_choice("alst|alst+offload")] == ["alst", "alst+offload"]
    for text in BEST.values():  # the default stacks parse, each a choice of one stack
        assert len({s.name for s in parse_choice(text)}) == 1
    for bad in ("ours", "alst:3", "hf+overlap", "alst+nooverlap", "alst+moments", "hf+offload",
                "hf@fp16", "ours:auto+overlap+moments",
                "ring:5", "ours:best", "alst+nockpt", "ours:5+nockpt"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    for bad in ("hf|alst", "hf|hf", "hf|"):
        with pytest.raises(ValueError):
            parse_choice(bad)


def test_a_choice_falls_back_only_where_it_runs_out_of_memory(monkeypatch, tmp_path):
    """The fastest configuration first; where it runs out of memory the next one, from that
    length on (never the first again at a longer length); an error is no reason to fall back.
    The best rows say what was tried; ratios compare choices at their best."""
    canned = {  # what each configuration's process reports, by length
        "hf+nockpt": {256: "ok", 512: "OOM: CUDA out of memory",
                      1024: "skipped: OOM at a shorter length"},
        "hf": {512: "ok", 1024: "OOM: CUDA out of memory"},
        "alst": {256: "ok", 512: "error: RuntimeError: a bug", 1024: "skipped: error"},
        "alst+offload": {},
        "ours:5": {256: "ok", 512: "ok", 1024: "ok"}}
    calls = []

    def run_child(opts, spec, seq_lens, steps, share_s, result, init_from=None):
        calls.append((spec, list(seq_lens)))
        rows = [{"stack": spec, "seq_len": s, "status": canned[spec][s],
                 **({"tokens_per_s": 1000.0 / s, "step_time_s": 1.0, "peak_gib": 1.0}
                    if canned[spec][s] == "ok" else {})} for s in seq_lens]
        result["rows"] += rows  # as run.run_child records them
        return rows

    monkeypatch.setattr(run, "run_child", run_child)
    with pytest.raises(SystemExit) as stop:  # alst's error: the runner's exit code says so
        run.main(["--stacks", "ours:5", "hf+nockpt|hf", "alst|alst+offload", "--model",
                  "tiny", "--seq-lens", "256", "512", "1024", "--device", "cpu",
                  "--out", str(tmp_path / "peers.json")])
    assert stop.value.code == 1
    result = json.loads((tmp_path / "peers.json").read_text())  # written before the exit
    assert calls == [("ours:5", [256, 512, 1024]), ("hf+nockpt", [256, 512, 1024]),
                     ("hf", [512, 1024]), ("alst", [256, 512, 1024])]
    best = {(r["stack"], r["seq_len"]): r for r in result["best"]}
    assert best[("hf+nockpt|hf", 256)]["config"] == "hf+nockpt"
    at_512 = best[("hf+nockpt|hf", 512)]
    assert at_512["config"] == "hf" and at_512["status"] == "ok"
    assert [t["stack"] for t in at_512["tried"]] == ["hf+nockpt", "hf"]
    assert best[("hf+nockpt|hf", 1024)]["tried"][0]["status"] == \
        "not tried: out of memory at 512 tokens"
    assert best[("alst|alst+offload", 512)]["status"].startswith("error")  # no fallback
    assert result["longest_ok"] == {"ours:5": 1024, "hf+nockpt|hf": 512,
                                    "alst|alst+offload": 256}
    assert result["shortest_failure"]["hf+nockpt|hf"] == 1024
    assert {(r["peer"], r["seq_len"], r["peer_config"]) for r in result["ratios"]} == {
        ("hf+nockpt|hf", 256, "hf+nockpt"), ("hf+nockpt|hf", 512, "hf"),
        ("alst|alst+offload", 256, "alst")}


PEERS = ["--model", "tiny", "--seq-lens", "256", "--device", "cpu"]


@pytest.mark.parametrize("flags,needle", [
    (["--stacks", "ours:1", "--model", "nope"], "--model: unknown model preset 'nope'"),
    (["--stacks", "ours:9"], "ours takes a --stack level 0-5 or auto, got 9"),
    (["--stacks", "hf|ours:6"], "a choice is among configurations of one stack"),
    (["--stacks", "ours:auto"], "--stack auto plans for GPUs; on --device cpu give a level"),
    (["--stacks", "ours:1", "--lr", "-1"], "--lr must be a finite number >= 0, got -1.0"),
    (["--stacks", "ours:1", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["--stacks", "ours:1", "--seq-lens", "0"], "--seq-lens: the token count must be positive"),
    (["--stacks", "ours:1", "--check-loss", "abc"], "cannot read a token count from 'abc'"),
    (["--stacks", "ours:1", "--budget-s", "0"], "--budget-s must be a finite number of seconds"),
    (["--stacks", "ours:1", "--check-dir", "weights"], "add --check-loss"),
    (["--stacks", "ours:1", "--check-loss", "64", "--check-dir", "FULL"], "is not empty"),
    (["--stacks", "ours:1", "--check-loss", "64", "--check-dir", "FULL/kept.txt"],
     "a file of that name exists"),
])
def test_bad_flags_are_refused_before_any_stack_runs(flags, needle, tmp_path, capsys):
    """What every stack's process would fail on (a traceback each, the runner's exit code 0) or
    take silently is refused by the runner, naming it, before anything runs; a --check-dir that
    holds anything is never replaced by the check's export."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "kept.txt").write_text("an earlier run's")
    flags = [str(full) + f[4:] if f.startswith("FULL") else f for f in flags]
    with pytest.raises(SystemExit) as stop:
        run.main([*PEERS, *flags, "--out", str(tmp_path / "peers.json")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and needle in err.splitlines()[-1], err
    assert "Traceback" not in err and not (tmp_path / "peers.json").exists()
    assert (full / "kept.txt").read_text() == "an earlier run's"


@pytest.mark.parametrize("status,code", [("error: RuntimeError: a bug", 1),
                                         ("not run: process ended (exit code 1): x", 1),
                                         ("OOM: CUDA out of memory", 0),
                                         ("not run: stopped at the end of its budget share", 0)])
def test_the_runner_exits_non_zero_when_a_stack_fails_with_an_error(status, code, monkeypatch,
                                                                    tmp_path, capsys):
    """A row that ended in an error (or a process that ended without its row) makes the runner
    exit with code 1, naming it, after the JSON and the table; running out of memory or out of
    budget is a row like any other."""
    def run_child(opts, spec, seq_lens, steps, share_s, result, init_from=None):
        rows = [{"stack": spec, "seq_len": s, "status": status} for s in seq_lens]
        result["rows"] += rows
        return rows

    monkeypatch.setattr(run, "run_child", run_child)
    out = tmp_path / "peers.json"
    try:
        run.main([*PEERS, "--stacks", "hf", "--out", str(out)])
        exit_code = 0
    except SystemExit as stop:
        exit_code = stop.code
    err = capsys.readouterr().err
    assert exit_code == code and json.loads(out.read_text())["rows"][0]["status"] == status
    assert ("error: 1 row ended in an error" in err) == bool(code), err


def test_rows_and_ratios_on_cpu(tmp_path):
    out = tmp_path / "peers.json"
    run.main(["--stacks", "ours:4", "hf", "hf+nockpt|hf", "--model", "tiny", "--seq-lens", "256",
              "--steps", "2", "--device", "cpu", "--profile", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = {(r["stack"], r["seq_len"]): r for r in result["rows"]}
    for stack in ("ours:4", "hf", "hf+nockpt"):
        row = rows[(stack, 256)]
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and len(row["step_times_s"]) == 2
        # --profile: one more step profiled, its ops' own times in the row
        assert row["profile"]["profile_top_ops"][0]["own_ms"] > 0
        assert 5.0 < row["losses"][0] < 6.0  # ln(256) = 5.55 from a random init
    assert result["stack_info"]["ours:4"]["stack"] == "train.py --stack 4"
    assert rows[("ours:4", 256)]["techniques"].startswith("fsdp, ulysses, checkpoint")
    assert "none" in result["stack_info"]["hf+nockpt"]["checkpointing"]
    # both fit: the faster alone was tried (no checkpointing), the same loss as with it
    best = next(r for r in result["best"] if r["stack"] == "hf+nockpt|hf")
    assert best["config"] == "hf+nockpt" and [t["stack"] for t in best["tried"]] == ["hf+nockpt"]
    assert rows[("hf+nockpt", 256)]["losses"][0] == pytest.approx(rows[("hf", 256)]["losses"][0],
                                                                   rel=1e-5)
    assert [(r["ours"], r["peer"]) for r in result["ratios"]] == [("ours:4", "hf"),
                                                                   ("ours:4", "hf+nockpt|hf")]
    assert result["longest_ok"] == {"ours:4": 256, "hf": 256, "hf+nockpt|hf": 256}


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
    nothing: such a process ends at its next print (a closed pipe) at the earliest. The runner
    kills and reaps its stack before it exits, so the stack must be gone the moment the runner
    is: checked then, with no grace period to race."""
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
        # No wait: a reaped process has left /proc; a killed one not yet reaped (a zombie) has
        # an empty command line, which processes_running never matches.
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
