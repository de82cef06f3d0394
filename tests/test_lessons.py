"""Each lesson is one module in a process (support/lessons.py): a demo run as a script, which
then imports support/ (and through it every lesson by name), defines each class once."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Counts the classes the process defines, by name, then runs the demo as `python FILE ...` would.
RUN_COUNTING_CLASSES = """
import builtins, collections, runpy, sys
made = collections.Counter()
build_class = builtins.__build_class__

def counting(body, name, *bases, **options):
    made[name] += 1
    return build_class(body, name, *bases, **options)

builtins.__build_class__ = counting
script, *sys.argv[1:] = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
print("defined", made["BlockInputOffloader"], made["UntiedUlyssesAttention"])
"""


def test_a_demo_run_as_a_script_defines_each_lesson_class_once():
    """`python 03_checkpoint_offload.py`: its demo imports support.byte_counts, which imports
    every lesson by name; 03's BlockInputOffloader (and 05's class) are defined once."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", RUN_COUNTING_CLASSES,
                           str(ROOT / "03_checkpoint_offload.py"), "--model", "tiny",
                           "--seq-len", "64", "--layers", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "defined 1 1" in done.stdout, done.stdout[-2000:]
