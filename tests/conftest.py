import pytest
import torch

_slow_left_out = []


def pytest_collection_modifyitems(config, items):
    """GPU tests skip (with a reason) where CUDA is absent, instead of failing. Where there are
    fewer GPUs than a test's NCCL ranks, the ranks share them (tests/ranks.py)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_deselected(items):
    _slow_left_out.extend(item for item in items if "slow" in item.keywords)


def pytest_terminal_summary(terminalreporter):
    """Say what the quick loop left out, and how to run it: a slow test named on the command
    line is otherwise only 'deselected'."""
    if _slow_left_out:
        terminalreporter.write_line(f"{len(_slow_left_out)} slow tests left out (pytest.ini's "
                                    "-m 'not slow'); all of them: python -m pytest -m 'slow or "
                                    "not slow'")
