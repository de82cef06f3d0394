"""Run the stacks one process each, one after another, and compare them (bench/peers/__init__.py
says what each stack is and how to install DeepSpeed and Liger-Kernel).

    python -m bench.peers.run --stacks ours:4 ours:5 ours:5@cudnn alst hf \\
        --model llama3.2-3b --seq-lens 64K 128K --steps 3 --budget-s 420 --out peers.json
    python -m bench.peers.run --check-loss 4K --stacks ours:5 alst hf --model llama3.2-3b \\
        --out peers_check.json

A row: tokens/s = S / the median step time after the first (the first compiles and warms up;
ours with 08/09 after the first two, bench.report.first_timed_step; with fewer, after the
first), peak GiB = the largest torch.cuda.max_memory_allocated of the
row's steps (reset before each), with each step's peak reserved memory and allocator retries
(support.progress.allocator_retries) and the SM clock and power across the timed steps, or OOM
/ error with the first line of the message. Each stack's process runs the lengths in the order
given (the model built once where the stack allows) and stops at its first failure: the longer
lengths are marked skipped. Running out of memory is a row like any other; a row that ended in
an error (or a stack's process that ended before reporting it) makes the runner exit with code 1,
after the JSON and the table. The JSON (--out) is written again after every row; --profile adds
to each row a profile of one more step (device time per kind of kernel, the GPU's idle time).
--budget-s: a stack may use what is left of it when it starts, less --reserve-s for each stack
after it (the stacks go in the order given: put first what matters most); a row whose estimated
time (the last row's step time, scaled by (S / S_last)^1.6, x --steps) does not fit the stack's
share is skipped, and a process still running at the end of its share is stopped.

Each stack at its best (the default --stacks, common.BEST): a stack given as a choice 'A|B'
(hf+nockpt|hf: transformers without, then with gradient checkpointing; alst|alst+offload: ALST
with the model state on the GPU, then with ZeRO's offload) runs A first, over the lengths in
order, and only where A runs out of memory B from that length on: the fastest configuration
first, each alternative one process, none tried at a length longer than one where it already ran
out of memory (memory grows with the length), and any other failure ends the choice (a bug, not
a fit). ours:auto is train.py's own choice (--stack auto). The JSON's "best" has one row per
choice and length: the configuration that completed, and what was tried before it and why;
"ratios" compare these rows (choices at their best; single stacks with the model state in the
same place); "longest_ok" and "shortest_failure" bracket each stack's longest step among the
lengths given.

--check-loss LEN: one process writes a Hugging Face folder of our model (support/build.py's
random init, support/pretrained.export_hf, bf16) and computes its loss on the check's tokens in
fp32 as the reference, and the loss of a model of another seed as the control; each stack then
starts from that folder (ours: --init-from; hf and alst: from_pretrained) and takes two steps on
the same tokens at --lr 1e-3. Recorded: each stack's two losses and first gradient norm, their
differences from ours and from the reference, and the control's distance (what a difference of
weights looks like at this length: agreement well inside it means the same weights).
"""

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

from bench.peers.common import BEST, parse_choice, parse_spec, window
from bench.report import (GpuClocks, first_timed_step, profile, release, result_path,
                          steady_step_time, step_done, write_result)
from model import get_model_args
from support.config import AUTO, MAX_STACK, Config, default_lr
from support.data import parse_tokens
from support.pretrained import check_export_dir
from support.progress import allocator_retries

GiB = 2**30
GROWTH = 1.6  # a step's time grows about as S^1.6 between 64K and 256K (attention dominates)
CHECK_LR = 1e-3
ALLOCATOR = "expandable_segments:True"  # ALST's recommended setting, for every stack alike


# ---------------------------------------------------------------------------------------------
# The parent: one child process per stack, the JSON after every row, the table at the end.
# ---------------------------------------------------------------------------------------------

def main(argv=None):
    opts = parse_args(argv)
    if opts.child:
        return child_main(opts)
    choices = [parse_choice(text) for text in opts.stacks]
    result = {"what": "peers: ours vs DeepSpeed ALST vs transformers, one GPU",
              "model": opts.model, "seq_lens": opts.seq_lens, "steps": opts.steps,
              "stacks": opts.stacks, "budget_s": opts.budget_s, "rows": [], "stack_info": {},
              "lr": opts.lr, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)}
    started = time.perf_counter()
    if opts.check_loss:  # the same weights: each choice's first configuration
        result.update(seq_lens=[opts.check_loss], steps=2, lr=CHECK_LR)
        check_loss(opts, [specs[0] for specs in choices], result, started)
    else:
        result.update(how_best=BEST_NOTE, best=[])
        for index, (text, specs) in enumerate(zip(opts.stacks, choices)):
            result["best"] += run_choice(opts, text, specs, started, len(choices) - index - 1,
                                         result)
        result["ratios"] = ratios(result["best"], dict(zip(opts.stacks, choices)))
        result["longest_ok"] = longest_ok(result["best"], opts.stacks)
        result["shortest_failure"] = shortest_failure(result["best"], opts.stacks)
    write(opts.out, result)
    print_table(result)
    failed = failures(result["rows"])
    if failed:  # out of memory is a row like any other; an error is not
        row = failed[0]
        print(f"error: {len(failed)} row{'s' * (len(failed) > 1)} ended in an error, not out of "
              f"memory (the first: {row['stack']} at {row['seq_len']:,} tokens: "
              f"{row['status'][:200]}); every row is in {opts.out}", file=sys.stderr, flush=True)
        sys.exit(1)
    return result


def failures(rows: list) -> list:
    """The rows whose stack failed for another reason than memory or the budget: an error in
    its process (status "error: ..."), or a process that ended before it reported the row."""
    return [row for row in rows
            if row.get("status", "").startswith(("error", "not run: process ended"))]


BEST_NOTE = ("a choice's alternatives are tried fastest first at each length; the first that "
             "completes is its best there; one that ran out of memory is not tried at longer "
             "lengths; any other failure ends the choice")


def run_choice(opts, text: str, specs: list, started: float, stacks_after: int,
               result: dict) -> list:
    """A stack or a choice of stacks (module docstring) over --seq-lens: its "best" rows."""
    left, tried, rows_of = list(opts.seq_lens), {s: [] for s in opts.seq_lens}, {}
    for position, spec in enumerate(specs):
        if not left:
            break
        rows = {r["seq_len"]: r for r in run_child(opts, spec.text, left, opts.steps,
                                                   share(opts, started, stacks_after), result)}
        failed = next((s for s in left if rows[s].get("status") != "ok"), None)
        for seq_len in left:
            status = rows[seq_len].get("status", "?")
            if failed is not None and seq_len > failed and status.startswith("skipped: OOM"):
                status = f"not tried: out of memory at {failed:,} tokens"
            tried[seq_len].append({"stack": spec.text, "status": status})
            rows_of[seq_len] = rows[seq_len]
        out_of_memory = failed is not None and rows[failed]["status"].startswith("OOM")
        if not out_of_memory or position == len(specs) - 1:
            break
        left = left[left.index(failed):]  # the next alternative, from where this failed
    return [best_row(text, seq_len, rows_of.get(seq_len, {}), tried[seq_len])
            for seq_len in opts.seq_lens]


def best_row(text: str, seq_len: int, row: dict, tried: list) -> dict:
    """A choice's row at a length: the configuration that completed (or the last failure)."""
    keep = ("status", "tokens_per_s", "step_time_s", "peak_gib", "techniques")
    best = {"stack": text, "seq_len": seq_len, "config": row.get("stack"),
            **{k: row[k] for k in keep if k in row}, "tried": tried}
    best.setdefault("status", "not run")
    return best


def share(opts, started: float, stacks_after: int) -> float:
    """Seconds the next stack may use: the budget left, less a reserve for each after it."""
    return opts.budget_s - (time.perf_counter() - started) - opts.reserve_s * stacks_after


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", nargs="+", default=list(BEST.values()),
                        help="ours:N|auto[@KERNEL][+offload][+overlap|+nooverlap|+moments], "
                             "alst[@tiledloss|@sdpa][+offload], "
                             "hf[@fp32][+nockpt], or a choice A|B tried fastest first "
                             "(default: each stack at its best)")
    parser.add_argument("--model", default="llama3.2-3b", help="a preset of model.py")
    parser.add_argument("--seq-lens", nargs="+", default=["64K", "128K"], type=token_count)
    parser.add_argument("--steps", type=int, default=3, help="steps per row (the first warms up)")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--reserve-s", type=float, default=60.0,
                        help="the budget kept for each stack still to run")
    parser.add_argument("--lr", type=float, default=None,
                        help="every stack's learning rate (default: train.py's for the model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-loss", type=token_count, default=None, metavar="LEN",
                        help="instead of timing: the stacks' first losses from the same weights")
    parser.add_argument("--check-dir", default=None,
                        help="where --check-loss writes the shared weights: a new or empty "
                             "folder (default: a temp dir)")
    parser.add_argument("--profile", action="store_true",
                        help="one more step per row under torch.profiler: device time per kind "
                             "of kernel and the GPU's idle time (bench.report.profile)")
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="the JSON file (default: $OUT/peers.json)")
    # The child's own arguments (run by the parent, one process per stack):
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--deadline-s", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--init-from", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.steps < 1:
        parser.error(f"--steps must be at least 1, got {opts.steps}")
    if opts.child is None:
        check_flags(parser, opts)
        if opts.out is None:
            opts.out = str(Path(os.environ.get("OUT", ".")) / "peers.json")
        if not opts.out.endswith(".json"):
            parser.error(f"--out {opts.out}: name a .json file")
        try:  # the parent writes it after every row: never over an earlier run's
            result_path(Path(opts.out).stem, str(Path(opts.out).parent))
        except FileExistsError as error:
            parser.error(str(error))
        if opts.lr is None:  # train.py's for the model, passed to every stack
            opts.lr = default_lr(Config(model=opts.model))
    return opts


def token_count(text: str) -> int:
    """--seq-lens' and --check-loss's type: parse_tokens, its refusal as argparse's message."""
    try:
        return parse_tokens(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_flags(parser, opts) -> None:
    """The parent's flags, refused by name (parser.error) before any stack's process starts:
    each would otherwise fail in every child (a traceback per stack) or be taken silently."""
    for text in opts.stacks:
        try:
            specs = parse_choice(text)
        except ValueError as error:
            parser.error(str(error))
        for spec in specs:
            if spec.name == "ours" and spec.level != AUTO and not 0 <= spec.level <= MAX_STACK:
                parser.error(f"stack {spec.text!r}: ours takes a --stack level 0-{MAX_STACK} or "
                             f"auto, got {spec.level}")
            if spec.name == "ours" and spec.level == AUTO and opts.device == "cpu":
                parser.error(f"stack {spec.text!r}: --stack auto plans for GPUs; on --device cpu "
                             f"give a level (ours:0 to ours:{MAX_STACK})")
    try:
        get_model_args(opts.model)
    except ValueError as error:
        parser.error(f"--model: {error}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here")
    if opts.lr is not None and not (math.isfinite(opts.lr) and opts.lr >= 0):
        parser.error(f"--lr must be a finite number >= 0, got {opts.lr}")
    if not (math.isfinite(opts.budget_s) and opts.budget_s > 0):
        parser.error(f"--budget-s must be a finite number of seconds > 0, got {opts.budget_s}")
    if not (math.isfinite(opts.reserve_s) and opts.reserve_s >= 0):
        parser.error(f"--reserve-s must be a finite number of seconds >= 0, got {opts.reserve_s}")
    if opts.check_dir is not None:
        check_dir = opts.check_dir
        if opts.check_loss is None:
            parser.error("--check-dir is where --check-loss writes its weights: add --check-loss")
        if os.path.exists(check_dir) and not os.path.isdir(check_dir):
            parser.error(f"--check-dir {check_dir}: a file of that name exists; name a new or "
                         f"empty folder")
        if os.path.isdir(check_dir) and os.listdir(check_dir):
            parser.error(f"--check-dir {check_dir} is not empty: --check-loss would replace "
                         f"what it holds with its weights; name a new or empty folder")
        try:  # its parent must take the export's files
            check_export_dir(check_dir)
        except ValueError as error:
            parser.error(f"--check-dir {check_dir}: {error}")


def child_argv(opts, spec: str, seq_lens, steps: int, rows_file: str, deadline_s: float,
               init_from: str | None = None) -> list:
    argv = [sys.executable, "-m", "bench.peers.run", "--child", spec, "--model", opts.model,
            "--seq-lens", *map(str, seq_lens), "--steps", str(steps), "--seed", str(opts.seed),
            "--device", opts.device, "--rows-file", rows_file, "--deadline-s", str(deadline_s)]
    argv += ["--profile"] if opts.profile else []
    lr = CHECK_LR if opts.check_loss else opts.lr
    if lr is not None:
        argv += ["--lr", str(lr)]
    if init_from:
        argv += ["--init-from", init_from]
    return argv


def run_child(opts, spec: str, seq_lens, steps: int, share_s: float, result: dict,
              init_from: str | None = None) -> list:
    """One stack's process: its rows into result["rows"] (and the JSON) as they come; a row
    for every length it did not report. Returns this child's rows."""
    if share_s <= 0:
        rows = [{"stack": spec, "seq_len": s, "status": "skipped: no budget left"}
                for s in seq_lens]
        result["rows"] += rows
        write(opts.out, result)
        return rows
    rows_file = tempfile.mktemp(prefix="peers-rows-", suffix=".jsonl")
    deadline = time.time() + share_s
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)
    print(f"== {spec}: {', '.join(map(str, seq_lens))} tokens, {share_s:.0f} s", flush=True)
    process = subprocess.Popen(
        child_argv(opts, spec, seq_lens, steps, rows_file, deadline, init_from),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True, cwd=Path(__file__).resolve().parents[2])
    stopped = threading.Event()

    def stop_at_deadline():
        if process.poll() is None:
            stopped.set()
            print(f"== {spec}: its {share_s:.0f} s are up; stopping it", flush=True)
            kill_group(process)  # the child and what it started (DeepSpeed's compiles)

    tail, rows, info = [], [], {}
    timer = threading.Timer(max(0.0, deadline - time.time()) + 5, stop_at_deadline)
    try:
        timer.start()
        for line in process.stdout:
            print(f"[{spec}] {line}", end="", flush=True)
            tail = (tail + [line.strip()])[-30:]
            rows, info = read_rows(rows_file, rows, info, result, opts.out, spec)
        process.wait()
    finally:
        timer.cancel()
        if process.poll() is None:
            # The runner itself is stopping (SIGTERM from a `timeout`, Ctrl-C). The child runs
            # in its own session, so nothing else stops it: it would outlive the runner and
            # keep the GPU and its pinned host memory from the next run.
            kill_group(process)
    rows, info = read_rows(rows_file, rows, info, result, opts.out, spec)
    reported = {row["seq_len"] for row in rows}
    why = ("stopped at the end of its budget share" if stopped.is_set()
           else f"process ended (exit code {process.returncode}): {last_error(tail)}")
    # A row cut short keeps the steps it completed (each written by the child as it ended).
    steps = completed_steps(rows_file)
    missing = [{"stack": spec, "seq_len": s, "status": f"not run: {why}",
                "completed_steps": steps.get(s, [])}
               for s in seq_lens if s not in reported]
    result["rows"] += missing
    write(opts.out, result)
    if os.path.exists(rows_file):
        os.remove(rows_file)
    return rows + missing


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to a stack's process group (its own session), then wait for the stack, so that
    its GPU and pinned host memory are free when this returns."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass
    process.wait(timeout=60)


def read_rows(rows_file: str, rows: list, info: dict, result: dict, out: str, spec: str):
    """The child's new lines: rows (into result, JSON rewritten) and its description."""
    if not os.path.exists(rows_file):
        return rows, info
    with open(rows_file) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    new = [line for line in lines if "row" in line][len(rows):]
    described = [line["about"] for line in lines if "about" in line]
    if described:
        info = described[-1]
        result["stack_info"][spec] = info
    if new:
        result["rows"] += [line["row"] for line in new]
        write(out, result)
    return rows + [line["row"] for line in new], info


def completed_steps(rows_file: str) -> dict:
    """The steps the child finished, by length: {seq_len: [{"time_s", "peak_gib", "loss"}]}."""
    steps = {}
    if os.path.exists(rows_file):
        with open(rows_file) as f:
            for line in (json.loads(text) for text in f if text.strip()):
                if "step" in line:
                    step = dict(line["step"])
                    steps.setdefault(step.pop("seq_len"), []).append(step)
    return steps


def last_error(tail: list) -> str:
    errors = [line for line in tail if "Error" in line or "error" in line]
    return (errors or tail or ["no output"])[-1][:300]


def write(path: str, result: dict) -> None:
    """The JSON at --out (bench.report's write_result: never over an earlier run's file), saved
    again after every row."""
    write_result(Path(path).stem, result, str(Path(path).parent), announce=False)


# ---------------------------------------------------------------------------------------------
# The child: one stack, its lengths in order.
# ---------------------------------------------------------------------------------------------

def make_stack(spec, opts, device):
    if spec.name == "ours":
        from bench.peers import ours as module
    elif spec.name == "hf":
        from bench.peers import hf as module
    else:
        from bench.peers import alst as module
    return module.Stack(spec, opts.model, device, opts.init_from, opts.lr, opts.seed)


def child_main(opts) -> None:
    try:
        if opts.child == "export":
            return export_main(opts)
        return run_stack(opts)
    finally:
        if torch.distributed.is_initialized():  # ours and alst join a group of one
            torch.distributed.destroy_process_group()


def run_stack(opts) -> None:
    spec = parse_spec(opts.child)
    device = torch.device(opts.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    emit = rows_writer(opts.rows_file)
    started = time.perf_counter()
    try:
        stack = make_stack(spec, opts, device)
    except Exception as error:  # noqa: BLE001 - recorded as the rows' status
        if isinstance(error, ValueError):  # a configuration the stack refuses: its message
            print(f"error: {error}", flush=True)
        else:
            traceback.print_exc()
        status = failure_status(error)
        for seq_len in opts.seq_lens:
            emit({"row": {"stack": spec.text, "seq_len": seq_len, "status": status}})
        return
    print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    last = None  # (seq_len, step time) of the last completed row: the next one's estimate
    failed = None
    for seq_len in opts.seq_lens:
        row = {"stack": spec.text, "seq_len": seq_len}
        left = opts.deadline_s - time.time() if opts.deadline_s else float("inf")
        estimate = None if last is None else opts.steps * last[1] * (seq_len / last[0]) ** GROWTH
        if failed:
            row["status"] = f"skipped: {failed} at a shorter length"
        elif estimate is not None and estimate > left:
            row.update(status=f"skipped: budget (estimated {estimate:.0f} s, {left:.0f} s left)")
        else:
            row.update(measure(stack, seq_len, opts, device, emit))
            if row["status"] == "ok":
                last = (seq_len, row["step_time_s"])
            else:
                failed = row["status"].split(":")[0]
        emit({"row": row})
        emit({"about": stack.about()})
        print(f"{spec.text} {seq_len}: {summary(row)}", flush=True)


def measure(stack, seq_len: int, opts, device, emit) -> dict:
    """One row: --steps steps on the length's tokens (each step also emitted as it ends)."""
    tokens = window(stack.vocab_size, seq_len, opts.seed)
    times, peaks, reserved, retries, metrics = [], [], [], [], []
    # the SM clock and power across the steps the median is taken over, as bench.step
    # records them (a stack that puts less between its kernels may run them at a higher clock)
    on_gpu = device.type == "cuda"
    clocks = GpuClocks.of(device)
    try:
        stack.prepare(seq_len)
        with clocks:
            for step in range(opts.steps):
                if step == first_timed_step(getattr(stack, "optimizer", None)):
                    clocks.restart()
                step_done(device)
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats()
                    retried = allocator_retries()
                start = time.perf_counter()
                metrics.append(stack.step(tokens))
                step_done(device)
                times.append(time.perf_counter() - start)
                if on_gpu:
                    peaks.append(torch.cuda.max_memory_allocated() / GiB)
                    reserved.append(round(torch.cuda.max_memory_reserved() / GiB, 3))
                    retries.append(allocator_retries() - retried)
                print(f"  step {len(times) - 1}: {times[-1]:.2f} s, "
                      f"loss {metrics[-1]['loss']:.4f}"
                      + (f", peak {peaks[-1]:.1f} GiB" if peaks else ""), flush=True)
                emit({"step": {"seq_len": seq_len, "time_s": round(times[-1], 3),
                               "peak_gib": round(peaks[-1], 3) if peaks else None,
                               "loss": metrics[-1]["loss"]}})
    except Exception as error:  # noqa: BLE001 - OOM and the rest, recorded as the status
        traceback.print_exc()
        return {"status": failure_status(error), "step_times_s": times,
                "peak_gib": max(peaks) if peaks else None}
    step_time = steady_step_time(times, getattr(stack, "optimizer", None))
    profiled = {}
    if opts.profile:  # one more step, its time and memory not counted above
        try:
            profiled = {"profile": profile(lambda: stack.step(tokens), top=15)}
        except Exception as error:  # noqa: BLE001 - the measured steps stand without it
            profiled = {"profile": {"status": failure_status(error)}}
    return {"status": "ok", "tokens_per_s": round(seq_len / step_time, 1),
            "step_time_s": round(step_time, 3), "step_times_s": [round(t, 3) for t in times],
            "peak_gib": round(max(peaks), 3) if peaks else None,
            **({"reserved_gib": reserved, "alloc_retries": retries} if peaks else {}),
            **({"gpu_clocks_during_steps": clocks.summary} if on_gpu else {}),
            "losses": [m["loss"] for m in metrics], "grad_norms": [m["grad_norm"] for m in metrics],
            **{k: v for k, v in metrics[-1].items() if k not in ("loss", "grad_norm")},
            **profiled}


def failure_status(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:400]
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in first.lower():
        return f"OOM: {first}"
    return f"error: {type(error).__name__}: {first}"


def rows_writer(path: str | None):
    def emit(line: dict) -> None:
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(line, default=str) + "\n")
    return emit


def summary(row: dict) -> str:
    if row["status"] != "ok":
        return row["status"]
    peak = f", peak {row['peak_gib']:.1f} GiB" if row.get("peak_gib") is not None else ""
    return f"{row['tokens_per_s']:,.0f} tok/s ({row['step_time_s']:.2f} s/step){peak}"


# ---------------------------------------------------------------------------------------------
# --check-loss: the same weights through every stack.
# ---------------------------------------------------------------------------------------------

def check_loss(opts, specs, result: dict, started: float) -> None:
    folder = opts.check_dir or tempfile.mkdtemp(prefix="peers-check-")
    check = {"seq_len": opts.check_loss, "folder": folder, "lr": CHECK_LR, "stacks": {}}
    result["loss_check"] = check
    export_rows = run_child(opts, "export", [opts.check_loss], 1,
                            share(opts, started, len(specs)), result, init_from=folder)
    reference = export_rows[0] if export_rows else {}
    check["reference"] = {k: reference.get(k) for k in ("status", "loss_fp32", "control_loss")}
    for index, spec in enumerate(specs):
        rows = run_child(opts, spec.text, [opts.check_loss], 2,
                         share(opts, started, len(specs) - index - 1), result, init_from=folder)
        row = rows[0] if rows else {}
        check["stacks"][spec.text] = {k: row.get(k) for k in ("status", "losses", "grad_norms")}
    check.update(compare_losses(check, specs))


def compare_losses(check: dict, specs) -> dict:
    """Each stack's losses minus the first ours stack's, and its first loss minus the fp32
    reference; the control's distance from the reference, for scale."""
    stacks = check["stacks"]
    ok = {s: v for s, v in stacks.items() if v.get("status") == "ok" and v.get("losses")}
    ours = next((s.text for s in specs if s.name == "ours" and s.text in ok), None)
    reference = (check.get("reference") or {}).get("loss_fp32")
    control = (check.get("reference") or {}).get("control_loss")
    out = {"versus": ours, "differences": {}}
    if reference is not None and control is not None:
        out["control_distance"] = abs(control - reference)
    for name, values in ok.items():
        diff = {}
        if ours and name != ours:
            diff["first_loss_minus_ours"] = values["losses"][0] - ok[ours]["losses"][0]
            if len(values["losses"]) > 1 and len(ok[ours]["losses"]) > 1:
                diff["second_loss_minus_ours"] = values["losses"][1] - ok[ours]["losses"][1]
        if reference is not None:
            diff["first_loss_minus_reference"] = values["losses"][0] - reference
        out["differences"][name] = diff
    return out


def export_main(opts) -> None:
    """The check's shared weights: our model (support/build.py, seeded), exported bf16 as a
    Hugging Face folder; its fp32 loss on the check's tokens (weights rounded to bf16, as every
    stack loads them) and a control model's (another seed)."""
    from model import get_model_args, num_params
    from support import build, pretrained

    emit = rows_writer(opts.rows_file)
    seq_len = opts.seq_lens[0]
    row = {"stack": "export", "seq_len": seq_len}
    try:
        device = torch.device(opts.device)
        args = get_model_args(opts.model)
        tokens = window(args.vocab_size, seq_len, opts.seed).to(device)
        positions = torch.arange(seq_len, device=device)[None]
        losses = []
        for seed in (opts.seed, opts.seed + 1):
            model = build.build_model(args, device, seed=seed,
                                      exact_init=num_params(args) < 2e8)
            if seed == opts.seed:
                pretrained.export_hf(model, args, opts.init_from, dtype=torch.bfloat16)
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16).float())
                loss = model(tokens[:, :-1], positions, tokens[:, 1:]) / seq_len
            losses.append(float(loss))
            del model
            release(device)
        row.update(status="ok", loss_fp32=losses[0], control_loss=losses[1])
    except Exception as error:  # noqa: BLE001
        traceback.print_exc()
        row["status"] = failure_status(error)
    emit({"row": row})
    print(f"export: {row}", flush=True)


# ---------------------------------------------------------------------------------------------
# The comparison.
# ---------------------------------------------------------------------------------------------

def at_its_best(specs: list) -> bool:
    """A choice of configurations, or ours:auto: the stack picks where its model state goes."""
    return len(specs) > 1 or specs[0].level == "auto"


def ratios(best: list, choices: dict) -> list:
    """ours / peer at each length where both completed: tokens/s and peak memory. Stacks at
    their best (a choice, or ours:auto) are compared with every peer; single configurations
    where the model state is in the same place (both on the GPU, or both on the host)."""
    ok = {(r["stack"], r["seq_len"]): r for r in best if r.get("status") == "ok"}
    out = []
    for ours, our_specs in choices.items():
        if our_specs[0].name != "ours":
            continue
        for peer, peer_specs in choices.items():
            comparable = (at_its_best(our_specs) or at_its_best(peer_specs)
                          or our_specs[0].offload == peer_specs[0].offload)
            if peer_specs[0].name == "ours" or not comparable:
                continue
            for seq_len in sorted({s for _, s in ok}):
                a, b = ok.get((ours, seq_len)), ok.get((peer, seq_len))
                if a and b:
                    speed_ratio = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
                    peak_ratio = (round(a["peak_gib"] / b["peak_gib"], 3)
                                  if a.get("peak_gib") and b.get("peak_gib") else None)
                    out.append({"ours": ours, "peer": peer, "seq_len": seq_len,
                                "ours_config": a["config"], "peer_config": b["config"],
                                "tokens_per_s_ratio": speed_ratio, "peak_ratio": peak_ratio})
    return out


def longest_ok(best: list, stacks: list) -> dict:
    return {text: max([r["seq_len"] for r in best if r["stack"] == text
                       and r.get("status") == "ok"], default=None) for text in stacks}


def shortest_failure(best: list, stacks: list) -> dict:
    """Each stack's shortest length where no configuration completed for memory."""
    return {text: min([r["seq_len"] for r in best if r["stack"] == text
                       and r.get("status", "").startswith(("OOM", "skipped: OOM"))],
                      default=None) for text in stacks}


def print_table(result: dict) -> None:
    print(f"\n{result['model']}: {'stack':<22} {'tokens':>8} {'tok/s':>10} {'peak GiB':>9}  status")
    for row in result["rows"]:
        ok = row.get("status") == "ok" and "tokens_per_s" in row
        tok = f"{row['tokens_per_s']:,.0f}" if ok else "-"
        peak = f"{row['peak_gib']:.1f}" if ok and row.get("peak_gib") is not None else "-"
        status = row.get("status", "?")[:70]
        print(f"{'':{len(result['model']) + 2}}{row['stack']:<22} {row['seq_len']:>8} {tok:>10} "
              f"{peak:>9}  {status}")
    for row in result.get("best", []):
        if row["stack"] != row.get("config") or len(row["tried"]) > 1:  # a choice's pick
            tried = ", ".join(f"{t['stack']}: {t['status'][:40]}" for t in row["tried"])
            print(f"  best of {row['stack']} at {row['seq_len']}: {row.get('config')} ({tried})")
    for ratio in result.get("ratios", []):
        peak = f"x{ratio['peak_ratio']:.2f}" if ratio["peak_ratio"] else "-"
        print(f"  {ratio['ours']} / {ratio['peer']} at {ratio['seq_len']}: tokens/s x"
              f"{ratio['tokens_per_s_ratio']:.2f}, peak {peak}")
    if result.get("loss_check"):
        check = result["loss_check"]
        print(f"  loss check at {check['seq_len']}: reference {check.get('reference')}")
        for name, values in check["stacks"].items():
            print(f"    {name}: {values.get('status')} losses {values.get('losses')} "
                  f"{check.get('differences', {}).get(name, '')}")
        print(f"    control distance (another seed): {check.get('control_distance')}")


def exit_on_sigterm(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the cleanup short
    raise SystemExit(128 + signum)  # unwinds through run_child's finally: the child goes too


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    main()
