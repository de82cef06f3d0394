"""The memory progression: one model, one length, each technique added in turn: the
README's memory story (the Untied Ulysses paper's per-GPU memory chart), measured on our GPUs.

    python -m bench.progression --gpus 2 --seq-len 64K          # runs torchrun for each config

For each configuration it runs bench/step.py under torchrun (full steps through train.py's own
functions) and collects per-GPU: model state (fp32 parameters + gradients + Adam, measured after
the first optimizer step), the step's peak, and what the step needs beyond the model state;
"OOM" with the allocation that failed when a configuration does not fit. With --snapshot,
step.py also reads PyTorch's memory snapshot (bench/snapshot.py): the peak split into model
state, attention and other, and for an OOM what was alive and which request failed, where.
Writes progression_<model>_<gpus>gpu.json and a stacked-bar PNG when matplotlib is there.
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
from bench.report import claim_result, default_out_dir, refuse_without_gpu, write_result

# (label, train.py flags); "none" is one process: without FSDP nothing keeps ranks in sync
CONFIGS = [
    ("none", []),
    ("FSDP", ["--fsdp"]),
    ("+Ulysses", ["--stack", "2"]),
    ("+checkpointing", ["--stack", "2", "--checkpoint"]),
    ("+offload", ["--stack", "3"]),
    ("+tiling (ALST)", ["--stack", "4"]),
    ("+Untied Ulysses", ["--stack", "5", "--head-chunk", "P"]),  # U = P: the least memory
]


def run_config(label, flags, opts, tmp):
    name = "step_" + "".join(c for c in label if c.isalnum())
    gpus = 1 if not flags else opts.gpus
    cmd = ["torchrun", "--nproc-per-node", str(gpus), "-m", "bench.step", "--name", name,
           "--out", tmp, "--steps", str(opts.steps)]
    if opts.layers:
        cmd += ["--layers", str(opts.layers)]
    if opts.snapshot:
        cmd += ["--snapshot"]
    flags = [str(gpus) if flag == "P" else flag for flag in flags]
    cmd += ["--", "--model", opts.model, "--seq-len", opts.seq_len, *flags]
    print(" ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout,
                              cwd=HERE.parent)  # python -m bench.step runs from the repo root
    except subprocess.TimeoutExpired:  # the next configurations still run
        return {"status": f"timeout ({opts.timeout:.0f} s)", "label": label, "flags": flags}
    path = Path(tmp, f"{name}.json")
    if path.exists():
        result = json.loads(path.read_text())
    else:
        tail = (proc.stdout + proc.stderr)[-2000:]
        oom = "out of memory" in tail.lower()
        result = {"status": "OOM" if oom else "error", "error": tail}
    result["label"], result["flags"] = label, flags
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--seq-len", default="64K")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="labels to run")
    parser.add_argument("--timeout", type=float, default=400)
    parser.add_argument("--out", default=None)
    parser.add_argument("--snapshot", action="store_true",
                        help="split each peak with the memory snapshot")
    opts = parser.parse_args()
    refuse_without_gpu("progression.py")
    rows = []
    result = {"what": "memory progression, per-GPU", "model": opts.model, "seq_len": opts.seq_len,
              "gpus": opts.gpus, "layers": opts.layers, "rows": rows}
    name = f"progression_{opts.model}_{opts.gpus}gpu"
    claim_result(name, opts.out)  # never over an earlier run's result
    with tempfile.TemporaryDirectory() as tmp:
        for label, flags in CONFIGS:
            if opts.only and label not in opts.only:
                continue
            row = run_config(label, flags, opts, tmp)
            rows.append(row)
            print(f"{label:<18} {row['status']:<6} "
                  f"model {row.get('after_optimizer_step_gib', 0):6.1f} "
                  f"peak {max(row.get('peak_gib') or [0]):6.1f} GiB  "
                  f"step {row.get('step_time_s', 0):.2f}s", flush=True)
            write_result(name, result, opts.out, announce=False)  # a run cut short keeps its rows
    write_result(name, result, opts.out)
    plot(rows, Path(opts.out or default_out_dir()) / f"{name}.png", opts)


def plot(rows, path, opts):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    labels = [r["label"] for r in rows]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if any("memory_at_peak" in r for r in rows):  # measured split, from the memory snapshot
        parts = {name: [r["memory_at_peak"]["gib"][name] if "memory_at_peak" in r else 0
                        for r in rows]
                 for name in ("model state", "attention", "other")}
        bottom = [0.0] * len(rows)
        for name, values in parts.items():
            ax.bar(labels, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
        for i, r in enumerate(rows):
            if "memory_at_peak" not in r:  # failed before its steps (building the model)
                ax.text(i, 2, r["status"], ha="center", color="red", weight="bold")
                continue
            oom = r["memory_at_peak"].get("oom")
            if oom:  # the request that failed, on top of what was alive
                ax.bar(labels[i], oom["requested_gib"], bottom=bottom[i], color="none",
                       edgecolor="red", hatch="//")
                ax.text(i, bottom[i] + oom["requested_gib"] + 2,
                        f"OOM: +{oom['requested_gib']:.1f} GiB\n{oom['owner']}", ha="center",
                        color="red", fontsize=7)
    else:  # no snapshot: model state and the rest of the peak
        model = [r.get("after_optimizer_step_gib") or 0 for r in rows]
        extra = [max(r.get("peak_gib") or [0]) - m if r["status"] == "ok" else 0
                 for r, m in zip(rows, model)]
        ax.bar(labels, model, label="model state (params + grads + Adam)")
        ax.bar(labels, extra, bottom=model, label="activations and temporaries at the peak")
        for i, r in enumerate(rows):
            if r["status"] != "ok":
                ax.text(i, max(model[i], 1) + 2, "OOM", ha="center", color="red", weight="bold")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.12)  # room for the OOM labels under the title
    ax.set_ylabel("GiB per GPU")
    ax.set_title(f"{opts.model}, {opts.seq_len} tokens, {opts.gpus} GPUs"
                 + (f", {opts.layers} layers" if opts.layers else ""))
    ax.legend()
    plt.xticks(rotation=15)
    plt.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
