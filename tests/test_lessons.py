"""Each lesson is one module in a process (support/lessons.py): a demo run as a script, which
then imports support/ (and through it every lesson by name), defines each class once."""

import ast
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


# The layers (base/__init__.py, support/__init__.py): every import points down.

def project_imports(path: Path, module_level: bool = False) -> set:
    """The project modules `path` imports (importlib's by name too; module_level: only in its
    top-level statements, not inside functions), as dotted names of files: "model",
    "base.kernels", "support.config", "02_ulysses", ..."""
    tree = ast.parse(path.read_text())
    nodes = ((n for statement in tree.body if not isinstance(
                 statement, (ast.FunctionDef, ast.ClassDef)) for n in ast.walk(statement))
             if module_level else ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return {name for name in names if module_path(name) is not None}


def module_path(name: str) -> Path | None:
    path = ROOT.joinpath(*name.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def reached(name: str, module_level: bool = False) -> set:
    """Every project module `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for other in project_imports(module_path(todo.pop()), module_level) - seen:
            seen.add(other)
            todo.append(other)
    return seen


LESSONS = {p.stem for p in ROOT.glob("0[0-9]_*.py")}


def test_every_import_points_down():
    """model.py imports nothing of the project; base/ only base/; a lesson (its module, not the
    demo below its marker, a command that uses support/ as train.py does) only model.py, base/
    and the lessons before it; support/config.py (and what it imports) no lesson; train.py the
    planner only inside a function; support/ no command (plan.py, train.py, eval.py)."""
    assert reached("model") == set()
    for path in (ROOT / "base").glob("*.py"):
        assert all(name.startswith("base") for name in reached(f"base.{path.stem}")), path
    for lesson in LESSONS:
        below = {other for other in LESSONS if other < lesson} | {"model"}
        assert all(name in below or name.startswith("base")
                   for name in reached(lesson, module_level=True)), (lesson, reached(lesson))
    assert not reached("support.config") & (LESSONS | {"support.lessons"})
    assert "plan" not in reached("train", module_level=True)  # only where a run plans
    for path in (ROOT / "support").glob("*.py"):
        commands = {"plan", "train", "eval"} & reached(f"support.{path.stem}")
        assert not commands, (path, commands)
