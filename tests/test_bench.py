"""The GPU benchmarks still run: each script's CPU smoke mode on the tiny model, in 2 processes
(torchrun), writing its JSON to a temporary folder. The numbers mean nothing on a CPU; what this
catches is a benchmark broken by a change elsewhere (a renamed helper, a removed function) before
it costs a GPU session."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SMOKE_RUNS = {
    "throughput": ["--device", "cpu", "--model", "tiny", "--seq-lens", "256",
                   "--methods", "none", "ulysses", "untied:8"],
    "tiling": ["--device", "cpu", "--model", "tiny", "--seq-lens", "512", "--step-seq-lens", "256",
               "--layers", "2", "--repeats", "1"],
    "offload": ["--device", "cpu", "--model", "tiny", "--parts", "fits", "layers", "--fits-seq-len",
                "256", "--layers-seq-len", "256", "--steps", "2"],
    "untied": ["--model", "tiny", "--seq-lens", "256", "--chunks", "2", "8", "--repeats", "1"],
}


@pytest.mark.parametrize("script", sorted(SMOKE_RUNS))
def test_benchmark_runs_on_cpu(script, tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone", str(ROOT / "bench" / f"{script}.py"), *SMOKE_RUNS[script],
               "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{script}.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    results = list(tmp_path.glob("*.json"))
    assert results, f"{script}.py wrote no JSON"
    for path in results:
        assert json.loads(path.read_text())  # a complete, parseable result
