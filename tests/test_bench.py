"""The GPU benchmarks still run: each script's CPU smoke mode on the tiny model, in 2 processes
(torchrun), writing its JSON to a temporary folder. The numbers mean nothing on a CPU; what this
catches is a benchmark broken by a change elsewhere (a renamed helper, a removed function) before
it costs a GPU session."""

import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.config import Config
from support import step_time

ROOT = Path(__file__).resolve().parents[1]

SMOKE_RUNS = {
    "throughput": ["--device", "cpu", "--model", "tiny", "--seq-lens", "256",
                   "--methods", "none", "ulysses", "untied:8", "ulysses+ring:2"],
    "max_length": ["--device", "cpu", "--model", "tiny", "--methods", "ulysses", "untied",
                   "--first-length", "1K", "--granularity", "256", "--max-trials", "2"],
    "max_length:forward_only": ["--device", "cpu", "--model", "tiny", "--methods", "untied",
                                "--first-length", "1K", "--granularity", "256", "--max-trials", "1",
                                "--forward-only"],
    "max_length:offload_model_state": ["--device", "cpu", "--model", "tiny", "--methods", "untied",
                                       "--first-length", "1K", "--granularity", "256",
                                       "--max-trials", "2", "--offload-model-state"],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_benchmark_runs_on_cpu(script, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", "-m", f"bench.{script.split(':')[0]}", *SMOKE_RUNS[script],
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, \
        f"{script}.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = list(tmp_path.glob("*.json"))
    assert results, f"{script}.py wrote no JSON"
    for path in results:
        assert json.loads(path.read_text())  # a complete, parseable result


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("script,needle", [("throughput", "--device cpu --model tiny"),
                                           ("ring_blocks", "--device cpu --model tiny"),
                                           ("progression", "no CPU form"),
                                           ("rms_norm", "no CPU form"),
                                           ("grad_sums", "no CPU form")])
def test_benchmarks_stop_at_once_without_a_gpu(script, needle):
    """Without a GPU a full-size benchmark would be killed for host memory minutes later (or fail
    inside NCCL): it stops at once and says what runs on a CPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", f"bench.{script}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "no CUDA GPU here" in done.stderr and needle in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_throughput_plot_needs_no_gpu(tmp_path):
    """--plot only reads saved results: it runs where no GPU is (and is not refused there)."""
    saved = tmp_path / "throughput.json"
    saved.write_text((ROOT / "docs" / "results" / "throughput_llama3-8b_2gpu.json").read_text())
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "bench.throughput", "--plot", str(saved)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert saved.with_suffix(".png").stat().st_size > 0


THROUGHPUT = ["--device", "cpu", "--model", "tiny", "--seq-lens", "256", "--methods", "ulysses"]


@pytest.mark.parametrize("flags,needle", [
    (["--seq-lens", "0"], "--seq-lens 0: the token count must be positive"),
    (["--seq-lens", "abc"], "--seq-lens abc: cannot read a token count"),
    (["--validate", "bogus"], "--validate bogus: expected METHOD:LENGTH"),
    (["--validate", "ulysses:x"], "--validate ulysses:x: cannot read a token count"),
    (["--no-cp-up-to", "x"], "--no-cp-up-to x: cannot read a token count"),
    (["--single-step-above", "x"], "--single-step-above x: cannot read a token count"),
    (["--methods", "untied:3"], "the head chunk U (3) to divide the query heads (8)"),
    (["--methods", "untied:0"], "only untied takes a head chunk, a whole number >= 1"),
    (["--methods", "ulysses:2"], "only untied takes a head chunk"),
    (["--methods", "ulysses@nope"], "the attention kernel must be one of auto, fa4"),
    (["--methods", "bogus"], "--methods bogus: unknown method 'bogus'"),
    (["--methods", "none+bogus"], "unknown method 'none+bogus'"),
    (["--methods", "none+ring:2"], "--ring is a setting of --ulysses or --untied"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--steps", "-1"], "--steps must be at least 1, got -1"),
    (["--budget-s", "-5"], "--budget-s must be a finite number of seconds > 0"),
    (["--model", "nope"], "--model: unknown model preset 'nope'"),
    (["--name", "../../x"], "--name must be a file name, no folder"),
    (["--out", "EARLIER"], "is a file: --out names the folder"),
    (["--plot", "MISSING"], "missing.json: cannot read it (No such file or directory)"),
    (["--plot", "NOT_JSON"], "not_json.json: not a JSON file"),
    (["--recount", "WRONG"], "wrong.json: not a bench.throughput result (it has no model"),
    (["--rows-from", "WRONG"], "wrong.json: not a bench.throughput result"),
    (["--bound-of", "A_LIST"], "a_list.json: not a bench.step or bench/peers result"),
    ([], "holds an earlier run's result; give this run another --name (or --out)"),
])
def test_throughput_refuses_bad_flags_before_it_runs(flags, needle, tmp_path, monkeypatch,
                                                     capsys):
    """Every value bench.throughput reads is refused by name (argparse's error, exit code 2),
    before a process group, a model or a result file: a length or method it cannot read or run
    here, a count of steps, a result name with folders, a JSON file that is missing or not the
    kind the flag reads, and a result file an earlier run wrote (kept as it is)."""
    throughput = importlib.import_module("bench.throughput")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    earlier = tmp_path / "throughput_tiny_1gpu_cpu.json"  # this command's result's name
    earlier.write_text('{"rows": ["an earlier run"]}')
    files = {"EARLIER": earlier, "MISSING": tmp_path / "missing.json",
             "NOT_JSON": tmp_path / "not_json.json", "WRONG": tmp_path / "wrong.json",
             "A_LIST": tmp_path / "a_list.json"}
    files["NOT_JSON"].write_text("rows: 1\n")
    files["WRONG"].write_text('{"what": "peers"}')
    files["A_LIST"].write_text("[1, 2]")
    flags = [str(files.get(f, f)) for f in flags]
    with pytest.raises(SystemExit) as stop:
        throughput.main([*THROUGHPUT, "--out", str(tmp_path), *flags])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and needle in err.splitlines()[-1], err
    assert earlier.read_text() == '{"rows": ["an earlier run"]}'
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["throughput_tiny_1gpu_cpu.json", "not_json.json", "wrong.json", "a_list.json"])


def test_throughput_says_an_earlier_result_exists_without_a_traceback(tmp_path):
    """The command line itself: the one-line refusal on stderr, no traceback, the file kept."""
    earlier = tmp_path / "mine.json"
    earlier.write_text("{}")
    done = subprocess.run([sys.executable, "-m", "bench.throughput", *THROUGHPUT, "--name",
                           "mine", "--out", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"error: {earlier} holds an earlier run's result" in done.stderr
    assert earlier.read_text() == "{}"


def _frame(path: str, function: str) -> dict:
    return {"filename": str(ROOT / path), "line": 1, "name": function}


def test_snapshot_splits_the_peak_and_names_the_failed_request():
    """bench/snapshot.py's replay of an allocator trace (the format of
    torch.cuda.memory._snapshot()['device_traces']): the largest moment, split by who allocated,
    and an out-of-memory request with its owner. Frames innermost first, as the snapshot has them;
    one list outermost first (starting at <module>) checks that it is read the right way round."""
    from bench import snapshot

    def alloc(addr, size, *frames):
        return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}

    free = lambda addr, size: {"action": "free_requested", "addr": addr, "size": size}  # noqa: E731
    entry = _frame("train.py", "<module>")
    trace = [
        alloc(1, 100 * 2**30, _frame("01_fsdp.py", "build_model"), entry),  # before the step
        alloc(2, 512, _frame("bench/snapshot.py", snapshot.STEP_MARK)), free(2, 512),
        alloc(3, 50 * 2**30, _frame("model.py", "causal_attention"), _frame("02_ulysses.py", "x")),
        alloc(4, 30 * 2**30, entry, _frame("04_alst_tiling.py", "tiled_mlp_forward")),  # reversed
        alloc(5, 20 * 2**30, {"filename": "/t/torch/optim/adamw.py", "line": 1, "name": "adamw"}),
        alloc(8, 10 * 2**30, {  # a backward kernel: C++ frames only
            "filename": "", "line": 0,
            "name": "at::_ops::_scaled_dot_product_cudnn_attention_backward::call(x)"}),
        free(3, 50 * 2**30),  # the peak was just before: 210 GiB
        alloc(6, 40 * 2**30, _frame("model.py", "rms_norm")),
    ]
    summary = snapshot.summarize({"device_traces": [trace]})
    assert summary["peak_gib"] == 210 and summary["first_step_found"]
    assert summary["gib"] == {"model state": 120, "attention": 60, "other": 30}
    assert summary["largest_owners"][0]["owner"] == "model.py:causal_attention"
    assert summary["largest_owners"][1]["owner"] == "04_alst_tiling.py:tiled_mlp_forward"
    assert "oom" not in summary
    # over the whole step, not only at the peak: rms_norm's 40 GiB came after it
    in_steps = {o["owner"]: o["largest_tensor_gib"]
                for o in summary["largest_allocations_in_steps"]}
    assert in_steps["model.py:causal_attention"] == 50 and in_steps["model.py:rms_norm"] == 40
    assert "01_fsdp.py:build_model" not in in_steps  # before the first step

    failed = {"action": "oom", "size": 125 * 2**30, "frames": [_frame("model.py", "loss_sum")]}
    summary = snapshot.summarize({"device_traces": [trace + [failed]]})
    assert summary["oom"] == {"requested_gib": 125, "owner": "model.py:loss_sum",
                              "allocated_gib": 200}
    assert summary["peak_gib"] == 200 and summary["gib"]["other"] == 70
    owners = [o["owner"] for o in summary["largest_owners"]]
    assert "at::_ops::_scaled_dot_product_cudnn_attention_backward::call" in owners


def test_max_length_search_brackets_the_limit(monkeypatch):
    """bench/max_length.py's search, with a stand-in trial that fits up to 5,000 tokens: it
    steps up from the first length until a trial fails, then bisects to the granularity."""
    from bench import max_length

    tried = []

    def fake_trial(base, method, seq_len, layers, forward_only=False):
        tried.append(seq_len)
        return {"seq_len": seq_len, "status": "completed" if seq_len <= 5000 else "OOM"}

    monkeypatch.setattr(max_length, "trial", fake_trial)
    room = lambda length, trials: True  # noqa: E731
    fits, fails, trials = max_length.search(None, "ulysses", 4096, 256, 0.1, 1, 20, room)
    assert (fits, fails) == (4864, 5120), tried
    assert tried[0] == 4096 and len(trials) == len(tried) <= 6
    fits, fails, _ = max_length.search(None, "ulysses", 8192, 256, 0.1, 1, 20, room)
    assert (fits, fails) == (4864, 5120)  # from above: steps down, then bisects
    # the budget check is asked for room for the next trial: the last one's time x length ratio^2
    done = {"seq_len": 1000, "status": "completed", "step_time_s": 9.0, "trial_s": 10.0}
    assert max_length.expected_seconds([done, {"seq_len": 4000, "status": "OOM"}], 2000) == 40.0
    saved = []
    max_length.search(None, "ulysses", 4096, 256, 0.1, 1, 2, room,
                      after_trial=lambda fits, fails, trials: saved.append(len(trials)))
    assert saved == [1, 2]  # saved after every trial


@pytest.mark.gpu
def test_snapshot_on_a_real_step_matches_the_allocator(tmp_path):
    """On a GPU: step.py --snapshot's replayed peak is the allocator's own maximum, its parts
    add up to it, and attention and model state are both found."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "1", "-m", "bench.step", "--snapshot", "--steps", "2",
               "--name", "snap", "--out", str(tmp_path), "--", "--model", "small", "--seq-len",
               "8K", "--stack", "4"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    memory = json.loads((tmp_path / "snap.json").read_text())["memory_at_peak"]
    assert memory["first_step_found"]
    assert memory["trace_complete"]
    # requested sizes vs the allocator's rounded blocks
    assert memory["peak_gib"] == pytest.approx(memory["max_memory_allocated_gib"], rel=0.02)
    assert sum(memory["gib"].values()) == pytest.approx(memory["peak_gib"], rel=1e-9)
    assert memory["gib"]["model state"] > 0 and memory["gib"]["attention"] > 0
    assert memory["largest_allocations_in_steps"][0]["largest_tensor_gib"] > 0


def test_context_file_needs_the_context_and_keeps_evaluation_apart(tmp_path):
    """bench/context_curve.py: training windows each repeat chunks of their own pool; the
    evaluation windows are a file of their own (no number of steps reaches them), and their
    share of chunks seen before grows with position."""
    import numpy as np

    from bench.context_curve import copy_bound, eval_path, write_context_files
    from support.data import sidecar_path

    path = str(tmp_path / "ctx.bin")
    written = write_context_files(path, train_len=255, train_windows=5, eval_len=511,
                                  eval_windows=2, chunk=8, train_pool=4, eval_pool=64,
                                  vocab_size=256)
    assert written == [path, str(tmp_path / "ctx.eval.bin")] == [path, eval_path(path)]
    train, evaluation = (np.fromfile(p, dtype=np.uint16) for p in written)
    assert train.size == 5 * 256 and evaluation.size == 2 * 512  # windows of length + 1, no gap
    sidecars = [json.loads(Path(sidecar_path(p)).read_text()) for p in written]
    assert [(s["part"], s["seq_len"], s["windows"]) for s in sidecars] == \
        [("training", 255, 5), ("evaluation", 511, 2)]
    assert len({tuple(c) for c in train[:256].reshape(-1, 8)}) <= 4  # one window's pool of 4
    seen, repeated = set(), []
    for chunk in map(tuple, evaluation[:512].reshape(-1, 8)):
        repeated.append(chunk in seen)
        seen.add(chunk)
    assert sum(repeated[:16]) < sum(repeated[-16:])  # later chunks were more often seen before
    assert not seen & {tuple(c) for c in train.reshape(-1, 8)}  # nothing from training
    with pytest.raises(ValueError, match="exists"):  # an earlier file is never written over unasked
        write_context_files(path, 255, 1, 511, 1, 8, 4, 64, 256)
    assert np.array_equal(np.fromfile(path, dtype=np.uint16), train)
    for bad, needle in ((dict(chunk=0), "--chunk must be at least 1"),
                        (dict(eval_windows=-1), "--eval-windows must be at least 0"),
                        (dict(vocab_size=70000), "uint16 ids"),
                        (dict(train_windows=0, eval_windows=0), "nothing to write")):
        with pytest.raises(ValueError, match=needle):
            write_context_files(str(tmp_path / "bad.bin"), **{**dict(
                train_len=8, train_windows=1, eval_len=8, eval_windows=1, chunk=2, train_pool=2,
                eval_pool=2, vocab_size=256), **bad})
    with pytest.raises(ValueError, match="is not a directory"):
        write_context_files(str(tmp_path / "no" / "c.bin"), 8, 1, 8, 1, 2, 2, 2, 256)
    assert not list(tmp_path.glob("bad*")) and not (tmp_path / "no").exists()
    assert write_context_files(str(tmp_path / "t.bin"), 8, 2, 8, 0, 2, 2, 2, 256) == \
        [str(tmp_path / "t.bin")]  # training windows only
    with pytest.raises(ValueError, match="holds training windows"):
        copy_bound(str(tmp_path / "t.bin"))
    with pytest.raises(ValueError, match="no sidecar written by bench/context_curve.py"):
        copy_bound(str(tmp_path / "nothing.bin"))
    Path(written[1]).unlink()
    with pytest.raises(ValueError, match="does not exist"):
        copy_bound(written[1])


@pytest.mark.parametrize("reach", [None, 64])
def test_the_ideal_copier_bound_counts_what_can_be_copied(tmp_path, reach):
    """bench/context_curve.py's bound, against a token-by-token count over every evaluation
    window: a token is free (loss 0) when its chunk occurred earlier in its window, within
    reach, and it is not the chunk's first token."""
    import numpy as np

    from bench.context_curve import copy_bound, write_context_files

    evaluation = write_context_files(str(tmp_path / "ctx.bin"), train_len=255, train_windows=2,
                                     eval_len=511, eval_windows=2, chunk=8, train_pool=4,
                                     eval_pool=24, vocab_size=256)[1]
    stream = np.fromfile(evaluation, dtype=np.uint16).tolist()
    expected = [[] for _ in range(511)]  # per input position, one loss per window
    for window in (stream[:512], stream[512:]):
        for target in range(1, 512):
            start = target - target % 8
            earlier = [s for s in range(0, start, 8) if window[s:s + 8] == window[start:start + 8]]
            copied = target % 8 and earlier and (reach is None or start - earlier[-1] <= reach)
            expected[target - 1].append(0.0 if copied else math.log(256))
    bound = copy_bound(evaluation, reach, bucket_start=64)
    assert bound["windows"] == 2 and [b["end"] for b in bound["buckets"]] == [64, 128, 256, 511]
    for bucket in bound["buckets"]:
        part = [loss for position in expected[bucket["start"]:bucket["end"]] for loss in position]
        assert bucket["tokens"] == len(part)
        assert bucket["mean_loss"] == pytest.approx(sum(part) / len(part), abs=1e-12)
    assert 0 < bound["buckets"][-1]["mean_loss"] < bound["buckets"][0]["mean_loss"]


@pytest.mark.slow
def test_the_context_curve_recipe_runs_end_to_end(tmp_path, capsys):
    """bench/context_curve.py's recipe, scaled down: train short, export, extend from the export,
    evaluate the held-out file, and draw it next to the ideal copier, whose buckets are
    eval.py's."""
    from bench.context_curve import copy_bound, write_context_files

    train, evaluate = importlib.import_module("train"), importlib.import_module("eval")
    short, long = str(tmp_path / "short.bin"), str(tmp_path / "long.bin")
    write_context_files(short, train_len=32, train_windows=8, eval_len=32, eval_windows=0,
                        chunk=4, train_pool=2, eval_pool=2, vocab_size=256)
    held_out = write_context_files(long, train_len=64, train_windows=2, eval_len=128,
                                   eval_windows=1, chunk=4, train_pool=4, eval_pool=8,
                                   vocab_size=256)[1]
    common = ["--fsdp", "--lr", "1e-3", "--warmup-steps", "1", "--steps", "2"]
    train.train(train.parse_args(common + ["--seq-len", "32", "--batch-size", "4", "--data", short,
                                           "--export-hf", str(tmp_path / "m32")]))
    train.train(train.parse_args(common + ["--init-from", str(tmp_path / "m32"), "--seq-len", "64",
                                           "--tile-loss", "--data", long,
                                           "--export-hf", str(tmp_path / "m64")]))
    after = tmp_path / "after.json"
    evaluate.main(["--init-from", str(tmp_path / "m64"), "--tile-loss", "--seq-len", "128",
                   "--data", held_out, "--windows", "1", "--bucket-start", "16",
                   "--out", str(after)])
    measured = json.loads(after.read_text())
    assert measured["label"] == str(tmp_path / "m64")  # named by what it loaded, not "random init"
    bound = copy_bound(held_out, reach=64, bucket_start=16)
    (tmp_path / "bound.json").write_text(json.dumps(bound))
    assert [(b["start"], b["end"], b["tokens"]) for b in measured["buckets"]] == \
        [(b["start"], b["end"], b["tokens"]) for b in bound["buckets"]]
    capsys.readouterr()
    evaluate.main(["--compare", str(after), str(tmp_path / "bound.json"),
                   "--out", str(tmp_path / "curve.png")])
    assert "different position buckets" not in capsys.readouterr().out
    (tmp_path / "coarse.json").write_text(json.dumps(copy_bound(held_out, bucket_start=32)))
    evaluate.main(["--compare", str(after), str(tmp_path / "coarse.json"),
                   "--out", str(tmp_path / "curve2.png")])
    assert "different position buckets" in capsys.readouterr().out


def test_ring_diagram_draws_06s_own_schedule(tmp_path, capsys):
    """bench/ring_diagram.py (the README's picture) reads 06's schedule: over R steps every block
    pair with keys not after queries is computed once, by the rank holding its query chunk,
    causal only on the diagonal, and every rank does the same work at every step; the command
    writes its PNG and refuses a ring it cannot draw."""
    from bench import ring_diagram

    ring_attention = importlib.import_module("06_ring_attention")
    for ring in (1, 2, 3, 4):
        schedule = ring_diagram.ring_schedule(ring)
        assert sorted((a, b) for *_, a, b, _ in schedule) == \
            [(a, b) for a in range(2 * ring) for b in range(a + 1)]
        for step, rank, a, b, causal in schedule:
            assert a in ring_attention.zigzag_chunks(rank, ring) and causal == (a == b)
            assert b in ring_attention.zigzag_chunks((rank - step) % ring, ring)
        assert ring_diagram.work_per_step(schedule, ring) == [[2.0] * ring] * ring
    pytest.importorskip("matplotlib")
    out = tmp_path / "ring.png"
    ring_diagram.main(["--ring", "3", "--out", str(out)])  # in-process: no torch start-up
    assert out.stat().st_size > 0 and "rank 2 (K/V of rank 0)" in capsys.readouterr().out
    with pytest.raises(ValueError, match="between 1 and 8"):
        ring_diagram.main(["--ring", "9", "--out", str(tmp_path / "no.png")])


def test_ulysses_diagram_draws_02s_own_exchange(tmp_path, capsys):
    """bench/ulysses_diagram.py (the README's picture) exchanges labelled tensors with 02's own
    patterns: before, rank r holds its S/P tokens of every head; after, all S tokens in order of
    its H/P heads; TO_TOKENS undoes it (checked inside `layouts`); the command writes its PNG
    and refuses a shape Ulysses cannot cut."""
    from bench import ulysses_diagram

    for ranks, seq_len, heads in ((1, 4, 2), (2, 8, 4), (4, 8, 8), (4, 12, 4)):
        before, after = ulysses_diagram.layouts(ranks, seq_len, heads)
        local, mine = seq_len // ranks, heads // ranks
        for rank in range(ranks):
            assert before[rank][:, :, 0].tolist() == \
                [[t] * heads for t in range(rank * local, (rank + 1) * local)]
            assert before[rank][0, :, 1].tolist() == list(range(heads))
            assert after[rank][:, :, 0].tolist() == [[t] * mine for t in range(seq_len)]
            assert after[rank][:, :, 1].tolist() == \
                [list(range(rank * mine, (rank + 1) * mine))] * seq_len
    pytest.importorskip("matplotlib")
    out = tmp_path / "ulysses.png"
    ulysses_diagram.main(["--ranks", "2", "--out", str(out)])  # in-process: no torch start-up
    assert out.stat().st_size > 0 and "rank 1: tokens 0-7 x heads 4-7" in capsys.readouterr().out
    with pytest.raises(ValueError, match="must both divide by --ranks"):
        ulysses_diagram.main(["--ranks", "3", "--out", str(tmp_path / "no.png")])


def test_kernel_classes_sort_a_traces_kernels():
    """Kernel names as an H200 trace of a 128K step has them, each in the class that the
    results' breakdown reads (docs/results.md, against the kernels' bound)."""
    from bench.report import kernel_classes, outside_kernels

    names = {
        "kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_0":
            "attention forward",
        "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_0":
            "attention backward",
        "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "matmul",
        "Memcpy HtoD (Pinned -> Device)": "host copies (03's offload, on its side stream)",
        "Memcpy DtoD (Device -> Device)": "copies and casts on the GPU",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
        "at::TensorIteratorBase&), at::native::memory::LoadWithCast<1> >":
            "copies and casts on the GPU",
        "void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, "
        "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >":
            "mixed-dtype elementwise",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>":
            "softmax (the loss)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>":
            "other (elementwise, reductions)",
    }
    names_by_kind = {kind.split()[0]: name for name, kind in names.items()}
    for name, kind in names.items():
        classes = kernel_classes([(name, 1000.0)])
        assert classes[kind] == {"ms": 1.0, "calls": 1}, (name, kind, classes)
    # The kernels outside matmul and attention, summed by name, the largest first.
    ranked = outside_kernels([(name, 1000.0) for name in names] + [(names_by_kind["softmax"],
                                                                    2500.0)])
    assert [row["ms"] for row in ranked] == [3.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert ranked[0] == {"kernel": names_by_kind["softmax"][:120], "class": "softmax (the loss)",
                         "ms": 3.5, "calls": 2}
    assert {row["class"] for row in ranked}.isdisjoint({"matmul", "attention forward",
                                                        "attention backward"})


def test_profile_counts_the_devices_kernels_once_and_the_time_outside_matmul_and_attention():
    """The profiler also puts record_function ranges (FSDP's, the optimizer's) on the GPU's
    timeline; counted as kernels they doubled the time of the kernels inside them (a 16K step's
    "other" class held 45 ms of them, AdamW's 26 ms twice). The time outside matmul and
    attention is the span less the union of their intervals: overlap on a side stream is free."""
    from types import SimpleNamespace

    from bench.report import device_kernels, timeline

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 0, 400),
              event("Optimizer.step#AdamW.step", 450, 1000, annotation=True),
              event("multi_tensor_apply_kernel<FusedAdamMathFunctor>", 500, 1000),
              event("aten::mm", 0, 400, device=cpu),
              event("flash_fwd_sm90", 300, 450),  # overlaps the matmul
              event("bfloat16_copy_kernel_cuda", 100, 200)]  # on a side stream, under it
    kernels = device_kernels(events)
    assert [name for _, _, name in kernels] == [
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT",
        "multi_tensor_apply_kernel<FusedAdamMathFunctor>", "flash_fwd_sm90",
        "bfloat16_copy_kernel_cuda"]
    summary = timeline(kernels)
    assert summary["profile_span_ms"] == pytest.approx(1.0)
    assert summary["profile_compute_busy_ms"] == pytest.approx(0.95)  # idle from 450 to 500
    assert summary["profile_outside_matmul_and_attention_ms"] == pytest.approx(0.55)  # 450-1000
    assert summary["profile_kernels"] == 4


def test_a_profile_with_warmup_records_the_last_call_alone():
    """With 08/09 bench.step profiles a steady step: one call first, which the profiler sees but
    does not record (its updates then run beside the recorded forward, as in a timed step), and
    the recorded step's own optimizer step after the record (`then`: its updates belong to the
    next forward)."""
    from bench.report import profile

    calls = []

    def fn():
        calls.append("step")
        weights = torch.ones(64, 64)
        return weights @ weights

    recorded = profile(fn, warmup=1, between=lambda: calls.append("between"))
    assert calls == ["step", "between", "step"]
    matmuls = [op["calls"] for op in recorded["profile_top_ops"] if op["op"] == "aten::mm"]
    assert matmuls == [1]

    def then():  # 08/09's optimizer step: after each call, the recorded one's outside the record
        calls.append("then")
        return torch.ones(1, 64, 64).bmm(torch.ones(1, 64, 64))

    calls.clear()
    recorded = profile(fn, warmup=1, between=lambda: calls.append("between"), then=then)
    assert calls == ["step", "then", "between", "step", "then"]
    ops = {op["op"] for op in recorded["profile_top_ops"]}
    assert "aten::mm" in ops and "aten::bmm" not in ops


# bench/bound.py: the kernels' bound of a step (bench.throughput), checked without a GPU.

def _bound_config(method: str, seq_len: int):
    from bench import throughput

    base = throughput.alst_config("llama3-8b", "cpu", "float32")
    return throughput.method_config(base, method, "llama3-8b", seq_len)


@pytest.mark.parametrize("method,world,seq_len,mlp_tile", [
    ("untied:1", 1, 128 * 1024, None), ("untied:8", 1, 128 * 1024, 16384),
    ("untied", 2, 1024 * 1024, None), ("ulysses", 2, 128 * 1024, 32768),
    ("none", 2, 64 * 1024, None), ("ulysses+keep-attention", 1, 1000, None)])
def test_the_bounds_gemms_are_the_steps_linear_flops_shape_by_shape(method, world, seq_len,
                                                                    mlp_tile):
    """The GEMMs the bound times (each at its shape and tile, as 04 and 05 cut them) add up to
    the linear FLOPs MFU counts; the layers' tiles and Untied's stages are what the step runs."""
    from bench import bound, throughput
    from model import get_model_args

    args = get_model_args("llama3-8b")
    cfg = _bound_config(method, seq_len)
    cfg.mlp_tile_tokens = mlp_tile
    cp = method != "none"
    tokens = seq_len // world if cp else seq_len
    gemms = bound.step_gemms(args, cfg, tokens, world if cp else 1)
    flops = throughput.step_flops(args, seq_len, 1 if cp else world)
    assert bound.gemm_flops(gemms) == pytest.approx(flops["linear"] / world, rel=1e-12)
    by_name = {g["name"].split(" ")[0]: g for g in gemms}
    tile = mlp_tile or args.dim
    assert by_name["gate"]["m"] <= tile and by_name["gate"]["forward"] == 2 * by_name["gate"][
        "backward"]  # forward and the tile's recompute, each backward product once
    assert by_name["down"]["forward"] == by_name["down"]["backward"]  # no recompute reads it
    if method.startswith("untied:"):
        chunk = int(method.split(":")[1])
        assert by_name["q"]["n"] == chunk * args.head_dim
        assert by_name["q"]["backward"] == args.n_layers * args.n_heads // chunk
    assert max(g["m"] for g in gemms if g["name"].startswith("lm_head")) <= 2092  # 1 GiB logits


@pytest.mark.parametrize("checkpoint,layers,tile_mlp,tile_loss", [
    (False, None, False, False), (True, None, False, False), (True, 5, False, True),
    (True, 5, True, False), (False, None, True, True)])
def test_the_bounds_gemms_follow_the_checkpointed_layers_and_the_tiles(checkpoint, layers,
                                                                       tile_mlp, tile_loss):
    """Any stack, not only the ALST one: --checkpoint-layers k recomputes k blocks' projections
    and gate and up, 04's tiled MLP every block's gate and up, and down_proj runs forward once
    per block in all of them; the GEMMs add up to step_time's linear FLOPs."""
    from bench import bound
    from model import get_model_args

    args = get_model_args("llama3-8b")
    cfg = Config(model="llama3-8b", seq_len=16384, checkpoint=checkpoint,
                 checkpoint_layers=layers, tile_mlp=tile_mlp, tile_loss=tile_loss)
    gemms = {g["name"].split(" ")[0]: g for g in bound.step_gemms(args, cfg, 16384)}
    flops = step_time.step_flops(args, 16384, checkpoint=checkpoint, checkpoint_layers=layers,
                                 tile_mlp=tile_mlp, tile_loss=tile_loss)
    assert bound.gemm_flops(list(gemms.values())) == pytest.approx(flops["linear"], rel=1e-12)
    recomputed = (layers or args.n_layers) if checkpoint else 0
    assert gemms["q"]["forward"] == args.n_layers + recomputed
    tiles = gemms["gate"]["backward"] // args.n_layers
    assert gemms["gate"]["forward"] == tiles * (args.n_layers
                                                + (args.n_layers if tile_mlp else recomputed))
    assert gemms["down"]["forward"] == gemms["down"]["backward"]


def test_a_recount_takes_out_what_the_old_count_had_too_many():
    """--recount (no GPU): a saved result's bound from its own measured rates and GEMM times,
    counted as now. The 16K-64K bound of 0e92ed9 was timed with down_proj's forward counted
    twice per layer (its tiles skipped the recompute's already): the recount is shorter by
    exactly those products' measured times, and the attention term is unchanged."""
    from bench import throughput

    results = ROOT / "docs" / "results"
    path = results / "throughput_llama3-8b_1gpu_bound_16k_64k.json"
    saved = json.loads(path.read_text())
    recounted = {e["seq_len"]: e for e in throughput.recount(str(path))}
    for entry in saved["table"]:
        gemms = saved["matmul"][throughput.matmul_key(entry["method"], entry["seq_len"])]["gemms"]
        too_many_s = sum((g["forward"] - g["backward"]) / 1e3
                         * saved["gemm_times_ms"][f"{g['m']}x{g['k']}x{g['n']}"]["forward_ms"]
                         for g in gemms if g["name"].startswith("down"))
        assert too_many_s > 0.01 * entry["kernel_bound_s"]  # the count was wrong
        now = recounted[entry["seq_len"]]
        assert now["attention_bound_s"] == pytest.approx(entry["attention_bound_s"])
        assert now["kernel_bound_s"] == pytest.approx(entry["kernel_bound_s"] - too_many_s)
    with pytest.raises(SystemExit, match="no GEMM times"):
        throughput.recount(str(results / "throughput_llama3-8b_1gpu_keep_attention_1m.json"))


def test_a_step_faster_than_its_bound_names_the_wrong_term():
    from bench import bound

    rate = {"attention_flops_per_s": 600e12, "attention_rate_seq_len": 1 << 20}
    terms = bound.kernel_bound(600e12 * 10.0, rate, 4.0, 700e12 * 4.0)  # 10 s + 4 s
    assert terms["kernel_bound_s"] == pytest.approx(14.0)
    assert terms["matmul_flops_per_s"] == pytest.approx(700e12)
    assert bound.faster_than_bound(14.0, terms, "row") is None  # at the bound: allowed
    alone = bound.faster_than_bound(9.0, terms, "ulysses at 1M")
    assert "ulysses at 1M" in alone and "the attention term is wrong" in alone
    assert "alone it is longer than the step" in alone and "1,048,576 tokens" in alone
    matmul = bound.faster_than_bound(3.5, bound.kernel_bound(600e12 * 2.0, rate, 4.0, 1e15),
                                     "row")
    assert "the matmul term is wrong" in matmul
    neither = bound.faster_than_bound(12.0, terms, "row")
    # neither term alone is longer: the larger is named, with the rate it would need (8 s)
    assert "the attention term is wrong" in neither and "would need 750 TFLOP/s" in neither


def test_the_bound_in_the_table_and_the_stop(monkeypatch):
    """summarize puts both terms in a row's entry; a step faster than its bound is an error
    (bench.throughput stops the run with it), one slower is not."""
    from bench import throughput
    from model import get_model_args

    args = get_model_args("llama3-8b")
    rows = [{"method": "ulysses@fa4", "seq_len": 131072, "layers": n, "status": "ok",
             "step_time_s": t} for n, t in ((1, 2.0), (2, 3.5))]  # 48.5 s extrapolated
    rates = {"131072@fa4": {"attention_flops_per_s": 660e12, "attention_rate_seq_len": 131072}}
    matmul = {throughput.matmul_key("ulysses@fa4", 131072): {"matmul_s": 11.0}}
    entry = throughput.summarize(rows, args, 1, rates, matmul)[0]
    attention = throughput.step_flops(args, 131072, 1)["attention"]
    assert entry["attention_bound_s"] == pytest.approx(attention / 660e12)
    assert entry["kernel_bound_s"] == pytest.approx(entry["attention_bound_s"] + 11.0)
    assert entry["step_over_bound"] == pytest.approx(48.5 / entry["kernel_bound_s"])
    assert entry["step_over_bound"] > 1 and throughput.faster_than_bounds([entry]) == []
    rows[1]["step_time_s"] = 2.5  # 17.5 s: faster than attention alone (~31 s)
    errors = throughput.faster_than_bounds(throughput.summarize(rows, args, 1, rates, matmul))
    assert len(errors) == 1 and "the attention term is wrong" in errors[0]
    assert "extrapolated from 1 and 2 layers" in errors[0]
    # an earlier result's table without the terms (no matmul) has no bound, and no error
    assert "kernel_bound_s" not in throughput.summarize(rows, args, 1, rates)[0]


def test_the_bounds_measurements_run_and_rotate_their_operands():
    """On the CPU (a host clock): the attention rate at its best (all heads, one call) and the
    GEMMs' times come back positive; every call of a timing takes the next operand set."""
    from bench import bound
    from bench.report import event_times_ms
    from model import get_model_args

    seen = []
    times = event_times_ms(lambda a: seen.append(a), warmup=1, repeats=4,
                           inputs=[(0,), (1,), (2,)], device="cpu")
    assert seen == [0, 1, 2, 0, 1] and len(times) == 4
    args = get_model_args("tiny")
    rate = bound.attention_rate(args, 256, "cpu", torch.float32, repeats=3)
    assert rate["attention_flops_per_s"] > 0 and len(rate["attention_times_ms"]) == 3
    # at its best: the faster of the step's call and the kernel's own forward + backward
    median = lambda times: sorted(times)[len(times) // 2]  # noqa: E731
    alone = median(rate["kernel_alone_ms"]["forward"]) + median(rate["kernel_alone_ms"]["backward"])
    step = median(rate["attention_times_ms"])
    best_ms = min(alone, step)
    assert rate["attention_flops_per_s"] == pytest.approx(
        bound.attention_flops(args, 256) / (best_ms / 1e3), rel=1e-2)  # times kept to 1 us
    if abs(alone - step) > 2e-3:  # the times are kept to 1 us: closer than that, either
        assert rate["attention_rate_from"] == (
            "the kernel's calls alone" if alone < step else "the step's call")
    assert rate["attention_rate_seq_len"] == 256 and "8 query / 2 KV heads" in rate[
        "attention_layout"]
    cfg = _bound_config("ulysses", 256)
    measured = {}
    gemms = bound.step_gemms(args, cfg, 256)
    seconds = bound.matmul_seconds(gemms, "cpu", torch.float32, measured)
    assert seconds > 0 and set(measured) == {bound.shape_key(g) for g in gemms}
    assert all(t > 0 for times in measured.values() for t in times.values())


def test_bound_of_full_depth_steps_counts_the_configuration_each_ran(tmp_path):
    """--bound-of: a full-depth step measured elsewhere (bench.step's result, bench/peers' ours
    rows) against the bound of its own Config: its checkpointed blocks and untiled MLP counted
    (fewer GEMMs than the bound's ALST stack), the rates and GEMM times of a saved
    bench.throughput result (--rates-from, no GPU); what it cannot bound honestly is refused."""
    import dataclasses

    import model as llama
    from bench import bound, throughput
    from support.step_time import step_flops

    RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
    rates = json.loads((RESULTS / "throughput_llama3-8b_1gpu_bound_16k_64k.json").read_text())
    cfg = Config(model="llama3-8b", seq_len=16384, fsdp=True, checkpoint=True, offload=True,
                 tile_loss=True, untied=True, head_chunk=32, keep_attention=True,
                 checkpoint_layers=10, dtype="bfloat16")
    step = {"world_size": 1, "layers": None, "config": dataclasses.asdict(cfg), "status": "ok",
            "gpu": "NVIDIA H200",
            "step_time_s": 1.9, "attention_kernel": "FlashAttention-4 (CuTe DSL)",
            "loss_tiles": throughput.LOSS_TILES, "command": "bench.step ..."}
    peers = {"world_size": 1, "gpu": "NVIDIA H200",
             "stack_info": {"ours:auto": {"attention": "FlashAttention-4 (x)"}},
             "rows": [{"stack": "ours:auto", "status": "ok", "step_time_s": 1.9,
                       "config": dataclasses.asdict(cfg), "loss_tiles": throughput.LOSS_TILES},
                      {"stack": "hf", "status": "ok", "step_time_s": 2.4}]}
    paths = []
    for name, content in (("step.json", step), ("peers.json", peers)):
        paths.append(str(tmp_path / name))
        Path(paths[-1]).write_text(json.dumps(content))
    table = throughput.bound_of_saved_rates(paths, str(RESULTS / "throughput_llama3-8b_1gpu_"
                                                       "bound_16k_64k.json"))
    assert len(table) == 2 and table[0]["kernel_bound_s"] == table[1]["kernel_bound_s"]
    args = llama.get_model_args("llama3-8b")
    gemms = bound.step_gemms(args, cfg, 16384)
    matmul_s = bound.matmul_seconds(gemms, "cpu", None, rates["gemm_times_ms"])
    alst = bound.step_gemms(args, throughput.full_depth_config(
        throughput.alst_config("llama3-8b", "cpu", "bfloat16"), "none+keep-attention@fa4",
        16384, rates), 16384)
    assert matmul_s < bound.matmul_seconds(alst, "cpu", None, rates["gemm_times_ms"])
    attention = step_flops(args, 16384, 1, True, checkpoint_layers=10)["attention"]
    assert table[0]["kernel_bound_s"] == pytest.approx(
        matmul_s + attention / rates["kernel_rates"]["16384@fa4"]["attention_flops_per_s"])
    assert table[0]["step_over_bound"] == pytest.approx(1.9 / table[0]["kernel_bound_s"])
    refused = {"records no Config": {**peers, "rows": [dict(peers["rows"][0], config=None)]},
               "not full depth": {**step, "layers": 2},
               "one GPU's steps only": {**step, "world_size": 2},
               "does not say how its tiled loss ran": {**step, "loss_tiles": None},
               "no fa4 rate at 2,048": {**step, "config": dict(step["config"], seq_len=2048)},
               "rates of llama3-8b": {**step, "config": dict(step["config"], model="tiny")},
               "2 micro-batches a step": {**step, "config": dict(step["config"], grad_accum=2)},
               "a step of bfloat16 on NVIDIA H100": {**step, "gpu": "NVIDIA H100"},
               "did not complete": {**step, "status": "OOM"}}
    for needle, content in refused.items():
        (tmp_path / "bad.json").write_text(json.dumps(content))
        with pytest.raises(SystemExit, match=needle):
            throughput.bound_of_saved_rates([str(tmp_path / "bad.json")], str(
                RESULTS / "throughput_llama3-8b_1gpu_bound_16k_64k.json"))


def test_bound_of_a_profiled_step_splits_its_time_against_the_bound(tmp_path, capsys):
    """--bound-of over bench.step --profile's result: its GEMMs and attention as they ran in the
    step, each over its own term of the bound, and the time with neither running; printed under
    its row. A step without a profile gets no split."""
    import dataclasses

    from bench import throughput

    RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
    cfg = Config(model="llama3-8b", seq_len=16384, fsdp=True, checkpoint=True, tile_loss=True,
                 keep_attention=True, checkpoint_layers=10, dtype="bfloat16")
    step = {"world_size": 1, "layers": None, "config": dataclasses.asdict(cfg), "status": "ok",
            "gpu": "NVIDIA H200", "step_time_s": 1.9, "attention_kernel": "FlashAttention-4",
            "loss_tiles": throughput.LOSS_TILES}
    classes = {"matmul": {"ms": 1200.0}, "attention forward": {"ms": 100.0},
               "attention backward": {"ms": 350.0}}
    profiled = {**step, "profile": {"profile_kernel_classes_ms": classes,
                                    "profile_outside_matmul_and_attention_ms": 250.0,
                                    "profile_compute_idle_ms": 30.0, "profile_span_ms": 1900.0}}
    for name, content in (("plain.json", step), ("profiled.json", profiled)):
        (tmp_path / name).write_text(json.dumps(content))
    plain, split = throughput.bound_of_saved_rates(
        [str(tmp_path / "plain.json"), str(tmp_path / "profiled.json")],
        str(RESULTS / "throughput_llama3-8b_1gpu_bound_16k_64k.json"))
    assert not any(key.startswith("in_step") for key in plain)
    assert split["in_step_matmul_over_bound"] == pytest.approx(1.2 / split["matmul_bound_s"])
    assert split["in_step_attention_over_bound"] == pytest.approx(
        0.45 / split["attention_bound_s"])
    assert (split["in_step_outside_ms"], split["in_step_idle_ms"]) == (250.0, 30.0)
    throughput.print_table([plain, split])
    printed = capsys.readouterr().out
    assert printed.count("its profiled step") == 1
    assert (f"GEMMs {1.2 / split['matmul_bound_s']:.3f}x their bound" in printed
            and "neither running 250 ms (the GPU idle 30)" in printed), printed


def test_bound_of_a_full_depth_train_py_run_reads_its_command_and_choice(tmp_path):
    """A train.py run saved by hand (docs/results/train_llama3-8b_1gpu_128k_auto.json: its
    command and what --stack auto chose, no Config) is bounded as the Config those flags make:
    the 128K full-depth Llama-3-8B step of dfc7e27, 38.72 s, against 128K rates measured on an
    H200 at fc61917, 0.930 of its bound (issue 43's full-depth row); a command without
    train.py, a choice naming no level, flags train.py no longer reads, or several GPUs are
    refused, and the kernel is the one the command names."""
    from bench import throughput

    RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
    rates = str(RESULTS / "throughput_llama3-8b_1gpu_bound_128k_kernel_alone.json")
    (step,) = throughput.full_depth_steps(str(RESULTS / "train_llama3-8b_1gpu_128k_auto.json"))
    cfg = step["cfg"]
    assert (cfg.seq_len, cfg.stack, cfg.untied, cfg.tile_loss, cfg.checkpoint_layers,
            cfg.head_chunk, cfg.keep_attention, cfg.mlp_tile_tokens, cfg.dtype) == (
        131072, 5, True, True, 26, 16, True, 16384, "bfloat16")
    assert step["kernel"] == "fa4" and step["loss_tiles"] == throughput.RECOMPUTED_LOSS_TILES
    (row,) = throughput.bound_of_saved_rates(
        [str(RESULTS / "train_llama3-8b_1gpu_128k_auto.json")], rates)
    assert row["kernel_bound_s"] == pytest.approx(36.004, abs=5e-4)
    assert 1 / row["step_over_bound"] == pytest.approx(0.930, abs=5e-4)
    saved = json.loads((RESULTS / "train_llama3-8b_1gpu_128k_auto.json").read_text())
    cudnn = dict(saved, command=saved["command"] + " --attn-kernel cudnn")
    refused = {"runs no train.py": dict(saved, command="python3 -m train --steps 2"),
               "names no --stack level": dict(saved, chosen=""),
               "flags train.py no longer reads": dict(saved, chosen="--stack 5 --tile-everything"),
               "2 GPUs": dict(saved, gpu_count=2)}
    for needle, content in refused.items():
        (tmp_path / "bad.json").write_text(json.dumps(content))
        with pytest.raises(SystemExit, match=needle):
            throughput.full_depth_steps(str(tmp_path / "bad.json"))
    (tmp_path / "cudnn.json").write_text(json.dumps(cudnn))
    assert throughput.full_depth_steps(str(tmp_path / "cudnn.json"))[0]["kernel"] == "cudnn"


def test_rows_from_an_earlier_result_get_the_bound_of_how_they_ran(tmp_path):
    """--rows-from: no steps; each saved (method, length) is measured with its own head chunk
    and MLP tile (05's default U = P where a row did not record it) and its tiled loss as it
    ran; another GPU count or model, or files whose tiled losses ran differently, are
    refused."""
    from bench import throughput
    from support.runtime import Runtime

    saved = {"model": "llama3-8b", "world_size": 2, "git_commit": "abc", "command": "x", "rows": [
        {"method": "untied", "seq_len": 131072, "layers": 1, "status": "ok", "step_time_s": 3.0},
        {"method": "untied", "seq_len": 131072, "layers": 2, "status": "ok", "step_time_s": 4.0},
        {"method": "ulysses", "seq_len": 131072, "layers": 1, "status": "ok",
         "mlp_tile_tokens": 16384, "step_time_s": 3.0},
        {"method": "ring", "seq_len": 131072, "layers": 1, "status": "OOM"}]}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(saved))
    base = throughput.alst_config("llama3-8b", "cpu", "float32")
    measured = []

    def measure(method, seq_len, full_depth):
        measured.append((method, seq_len, full_depth.head_chunk, full_depth.mlp_tile_tokens))

    result = {"model": "llama3-8b", "rows": []}
    throughput.rebound_rows([str(path)], result, base, Runtime(world=2), measure, lambda: True)
    assert measured == [("ulysses", 131072, None, 16384), ("untied", 131072, 2, None)]
    assert len(result["rows"]) == 4 and result["rows_from"][0]["git_commit"] == "abc"
    # a file from before 04's tiled loss ran its backward in forward: bounded as it ran
    assert throughput.recomputes_logits(result)
    newer = tmp_path / "new.json"
    newer.write_text(json.dumps({**saved, "loss_tiles": throughput.LOSS_TILES, "rows": [
        dict(r, seq_len=65536) for r in saved["rows"]]}))
    with pytest.raises(SystemExit, match="one kind per run"):
        throughput.rebound_rows([str(path), str(newer)], {"model": "llama3-8b", "rows": []},
                                base, Runtime(world=2), measure, lambda: True)
    with pytest.raises(SystemExit, match="also in an earlier file"):
        throughput.rebound_rows([str(path), str(path)], {"model": "llama3-8b", "rows": []}, base,
                                Runtime(world=2), measure, lambda: True)
    with pytest.raises(SystemExit, match="not llama3-8b on 1"):
        throughput.rebound_rows([str(path)], {"model": "llama3-8b", "rows": []}, base,
                                Runtime(world=1), measure, lambda: True)


def test_a_result_names_the_tracked_files_that_differ_from_its_commit(monkeypatch):
    """bench.report.environment: a result from an uncommitted tree (or a copy whose git metadata
    lags its files) lists the tracked files that differ from git_commit; a clean tree, None."""
    from bench import report

    for status, changed in ((" M train.py\nM  bench/step.py", ["train.py", "bench/step.py"]),
                            ("", None)):
        answers = {"rev-parse": "abc123", "status": status}
        monkeypatch.setattr(report, "git", lambda *args: answers[args[0]])
        env = report.environment()
        assert (env["git_commit"], env["git_changed_files"]) == ("abc123", changed)
    monkeypatch.setenv("GIT_COMMIT", "given")  # named by whoever ran it: nothing to compare
    assert report.environment()["git_changed_files"] is None


def test_a_result_never_replaces_an_earlier_runs_file(tmp_path, monkeypatch):
    """bench.report.write_result saves a run's result again after every configuration, but
    refuses a file that an earlier run wrote, naming it; benchmarks ask first (claim_result, on
    every rank), and bench/peers refuses an --out that exists, before measuring anything."""
    from bench import report
    from bench.peers import run as peers

    monkeypatch.setattr(report, "_written", set())
    earlier = tmp_path / "throughput_llama3-8b_1gpu.json"
    earlier.write_text('{"rows": ["an earlier run"]}')
    with pytest.raises(FileExistsError, match="earlier run's result"):
        report.claim_result("throughput_llama3-8b_1gpu", tmp_path)
    with pytest.raises(FileExistsError, match="throughput_llama3-8b_1gpu.json"):
        report.write_result("throughput_llama3-8b_1gpu", {"rows": []}, tmp_path)
    assert earlier.read_text() == '{"rows": ["an earlier run"]}'
    for rows in ([1], [1, 2]):  # this run's own saves replace each other
        report.write_result("this_run", {"rows": rows}, tmp_path, announce=False)
    assert json.loads((tmp_path / "this_run.json").read_text())["rows"] == [1, 2]
    with pytest.raises(SystemExit):
        peers.parse_args(["--stacks", "hf", "--out", str(earlier)])
    with pytest.raises(SystemExit):
        peers.parse_args(["--stacks", "hf", "--out", str(tmp_path / "peers.txt")])
    assert earlier.read_text() == '{"rows": ["an earlier run"]}'
    for rows in ([1], [1, 2]):  # bench/peers saves through write_result after every row
        peers.write(str(tmp_path / "peers.json"), {"rows": rows})
    assert json.loads((tmp_path / "peers.json").read_text())["rows"] == [1, 2]
    with pytest.raises(FileExistsError):
        peers.write(str(earlier), {"rows": []})


def test_gpu_clocks_are_summarized_and_absent_without_nvidia_smi(monkeypatch):
    """bench.report.GpuClocks: nvidia-smi's CSV samples (SM MHz, W, degrees C) as medians and
    extremes, lines cut short or "[N/A]" skipped; without nvidia-smi no summary, no error."""
    from bench.report import GpuClocks, clock_summary

    summary = clock_summary("1980, 650.5, 61\n1755, 700.0, 66\n[N/A], 1, 2\n1830, 69\n")
    assert summary == {"samples": 2, "sm_mhz_median": 1867.5, "sm_mhz_min": 1755.0,
                       "sm_mhz_max": 1980.0, "power_w_median": 675.25, "power_w_max": 700.0,
                       "temperature_c_max": 66.0}
    assert clock_summary("") is None
    monkeypatch.setenv("PATH", "/nonexistent")
    with GpuClocks() as clocks:
        pass
    assert clocks.summary is None


def test_gpu_clocks_restart_leaves_out_what_came_before(tmp_path, monkeypatch):
    """restart(): only samples taken after it are summarized (bench.step calls it after the
    first step, whose compiles and idle waits are not what the median step ran at)."""
    from bench.report import GpuClocks

    fake = tmp_path / "nvidia-smi"  # an idle GPU for 0.3 s, then a busy one
    fake.write_text("#!/bin/sh\nfor i in 1 2 3; do echo '345, 80.0, 30'; done\nsleep 0.3\n"
                    "while true; do echo '1755, 690.0, 64'; sleep 0.05; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    def written_past(clocks, size):  # (waits for the stand-in, however late it starts)
        deadline = time.monotonic() + 30
        while os.fstat(clocks.samples.fileno()).st_size < size and time.monotonic() < deadline:
            time.sleep(0.01)

    idle = len("345, 80.0, 30\n")
    with GpuClocks() as clocks:
        written_past(clocks, 3 * idle)
        clocks.restart()
        written_past(clocks, 3 * idle + len("1755, 690.0, 64\n"))
    assert clocks.summary["sm_mhz_min"] == 1755.0 and clocks.summary["power_w_median"] == 690.0
    with GpuClocks() as clocks:  # without restart(): everything
        written_past(clocks, 3 * idle + len("1755, 690.0, 64\n"))
    assert clocks.summary["sm_mhz_min"] == 345.0
    with GpuClocks.of("cpu") as clocks:  # not a GPU: nvidia-smi not asked, whatever GPU it has
        clocks.restart()
        time.sleep(0.2)
    assert clocks.process is None and clocks.summary is None


def test_bound_of_prints_the_clocks_beside_the_steps():
    """bench.throughput --bound-of: the SM clock and power while its kernels were timed alone,
    beside each step file's (bench.step's gpu_clocks_during_steps; files without them: none)."""
    throughput = importlib.import_module("bench.throughput")
    results = ROOT / "docs" / "results"
    during = json.loads((results / "bound_llama3.2-3b_1gpu_h100_08ab.json").read_text())[
        "gpu_clocks_during_bound"]
    steps = str(results / "step_llama3.2-3b_1gpu_32K_auto_10steps_08ab_h100.json")
    lines = throughput.clock_lines([steps, str(results / "grad_sums_1gpu.json")], during)
    assert lines == ["SM clock, median: the bound's kernels alone 1,980 MHz at 119 W",
                     "  step_llama3.2-3b_1gpu_32K_auto_10steps_08ab_h100.json's steps "
                     "1,440 MHz at 696 W"]
    assert throughput.clock_lines([steps], None) == []


def test_back_to_back_runs_each_pass_the_steps_kernels(monkeypatch):
    """bench/bound.py's back_to_back: every pass runs the step's GEMMs as often as the bound
    counts them (their FLOPs, by torch's own counter) and the attention kernel's forward and
    backward once per layer, with a forward alone again in each block 03 recomputes without
    --keep-attention (bench.throughput's attention_calls, held to the bound's FLOPs); a warm-up
    pass first, then passes until the time is spent, the median of the second half returned."""
    import dataclasses

    from torch.utils.flop_counter import FlopCounterMode

    import model as llama
    from bench import bound, throughput
    from base import kernels

    args = dataclasses.replace(llama.get_model_args("tiny"), n_layers=6)
    counted = {"forward": 0, "backward": 0}

    def forward(q, k, v):
        counted["forward"] += 1
        return torch.zeros_like(q), None

    def backward(grad, q, k, v, out, lse):
        counted["backward"] += 1

    monkeypatch.setattr(kernels, "attention_forward_lse", forward)
    monkeypatch.setattr(kernels, "attention_backward_lse", backward)
    for keep_attention, again in ((False, 4), (True, 0)):
        cfg = Config(model="tiny", seq_len=256, fsdp=True, checkpoint=True, checkpoint_layers=4,
                     keep_attention=keep_attention)
        gemms = bound.step_gemms(args, cfg, 256)
        flops = step_time.step_flops(args, 256, 1, keep_attention, checkpoint=True,
                                     tile_mlp=False, tile_loss=False, checkpoint_layers=4)
        assert throughput.attention_calls(args, cfg, flops["attention"]) == (6, again)
        with pytest.raises(SystemExit, match="the bound counts"):
            throughput.attention_calls(args, cfg, flops["attention"] * 1.01)
        counted.update(forward=0, backward=0)
        with FlopCounterMode(display=False) as flop_counter:
            result = bound.back_to_back(gemms, args, 256, 6, again, "cpu", torch.float32, 0.2)
        runs = 1 + result["back_to_back_passes"]  # the warm-up pass and the timed ones
        assert result["back_to_back_passes"] >= 2
        assert flop_counter.get_total_flops() == runs * bound.gemm_flops(gemms)
        assert counted == {"forward": runs * (6 + again), "backward": runs * 6}
        assert 0 < result["back_to_back_s"] and result["back_to_back_first_pass_s"] > 0
        assert result["gpu_clocks_back_to_back"] is None  # no GPU's clocks off a GPU


@pytest.mark.parametrize("flags", [["--back-to-back-s", "20"],
                                   ["--back-to-back-s", "20", "--bound-of", "a.json",
                                    "--rates-from", "b.json"]])
def test_back_to_back_needs_steps_to_run_on_this_gpu(flags, monkeypatch, capsys):
    """--back-to-back-s runs --bound-of's steps' kernels here: without --bound-of, or with
    --rates-from (no GPU), it is refused by name before anything runs."""
    throughput = importlib.import_module("bench.throughput")
    monkeypatch.setattr(sys, "argv", ["throughput.py", *flags])
    with pytest.raises(SystemExit):
        throughput.main()
    assert "--back-to-back-s runs the kernels of --bound-of's steps" in capsys.readouterr().err


def test_bound_of_adds_each_steps_kernels_back_to_back_to_its_entry():
    """--bound-of --back-to-back-s: after the bound (its clocks apart), each entry gets its own
    step's kernels back to back, their attention calls read from the entry's attention term
    (a step whose counts disagree with it stops the run), and the step over a pass."""
    throughput = importlib.import_module("bench.throughput")
    cfg = Config(model="tiny", seq_len=256, fsdp=True, checkpoint=True, checkpoint_layers=1)
    step = {"cfg": cfg, "loss_tiles": throughput.LOSS_TILES, "kernel": "math",
            "step_time_s": 1.0, "what": "a step"}
    rates = {"256@math": {"attention_flops_per_s": 1e11, "attention_rate_seq_len": 256}}
    table = throughput.bound_steps([step], rates, {}, "cpu", torch.float32)
    throughput.add_back_to_back([step], table, "cpu", torch.float32, 0.1)
    entry = table[0]
    assert entry["back_to_back_passes"] >= 1 and entry["gpu_clocks_back_to_back"] is None
    assert entry["step_over_back_to_back"] == pytest.approx(1.0 / entry["back_to_back_s"])
    wrong = throughput.bound_steps([step], rates, {}, "cpu", torch.float32)
    wrong[0]["attention_bound_s"] *= 1.01
    with pytest.raises(SystemExit, match="the bound counts"):
        throughput.add_back_to_back([step], wrong, "cpu", torch.float32, 0.1)


def test_a_timing_starts_where_the_optimizer_step_is_steady():
    """The median step leaves out step 0 (warm-up) and, with 08's or 09's optimizer (each
    block's update waits for its next forward, and step 0's were done within step 0), step 1
    too: its forward may wait for no update, so it would pull the median down."""
    from bench.report import first_timed_step, steady_step_time
    from reference import build_as_train

    train = importlib.import_module("train")
    times = [30.0, 0.84, 1.93, 2.06, 1.89]
    for flags, first in (({}, 1), ({"overlap_optimizer": True}, 2),
                         ({"offload_moments": True}, 2)):
        model, _, cfg = build_as_train(Config(model="tiny", seq_len=32, device="cpu", **flags))
        optimizer = train.make_optimizer(model, cfg)
        assert first_timed_step(optimizer) == first, flags
        assert steady_step_time(times, optimizer) == (1.91 if first == 1 else 1.93), flags
        assert steady_step_time(times[:2], optimizer) == 0.84, flags  # two: not the first
    assert steady_step_time([5.0]) == 5.0  # one step: its own time


def test_trace_gaps_tell_a_late_host_from_a_wait_on_another_stream():
    """bench/trace_gaps.py: a gap is the host's until its next kernel is launched, the GPU's
    wait after that, caused by what ended last on another stream; gaps shorter than the
    threshold and other streams' own gaps are not counted."""
    from bench import trace_gaps

    def kernel(ts, dur, correlation, stream=7, name="gemm"):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                "args": {"stream": stream, "correlation": correlation}}

    def launch(ts, correlation):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts,
                "dur": 5, "args": {"correlation": correlation}}

    copy = {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 4000, "dur": 1900,
            "args": {"stream": 24, "correlation": 9}}
    events = [kernel(0, 1000, 1), launch(0, 1),
              kernel(3000, 1000, 2), launch(2500, 2),  # 1.5 ms the host's, 0.5 waiting
              kernel(6000, 1000, 3), launch(3100, 3),  # queued before: waited for the copy
              kernel(7500, 1000, 4), launch(3200, 4),  # 0.5 ms: under the threshold
              kernel(0, 300, 5, stream=20), kernel(9000, 300, 6, stream=20), copy]
    found = trace_gaps.gaps(events, min_us=1000)
    assert [(g["start_ms"], g["ms"], g["host_ms"], g["waiting_ms"]) for g in found] == [
        (1.0, 2.0, 1.5, 0.5), (4.0, 2.0, 0.0, 2.0)]
    assert (found[1]["cause"], found[1]["cause_stream"]) == ("Memcpy HtoD", 24)
    assert trace_gaps.summary(found) == ("main-stream gaps: 2; the host late 1.5 ms, "
                                         "the GPU waiting 2.5 ms")
