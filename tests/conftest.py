import os

import pytest
import torch

TWO_GPUS = "needs 2 GPUs"  # the skipif reason of the tests that run 2 NCCL ranks
_slow_left_out = []


def pytest_collection_modifyitems(config, items):
    """GPU tests skip (with a reason) where CUDA is absent, instead of failing. With
    RANKS_ON_ONE_GPU=1 on a GPU machine (opt-in, tests/ranks.py: NCCL ranks share cuda:0 as
    separate hosts) the tests that need 2 GPUs run there too."""
    if torch.cuda.is_available():
        if os.environ.get("RANKS_ON_ONE_GPU") == "1":
            for item in items:
                item.own_markers = [m for m in item.own_markers
                                    if not (m.name == "skipif"
                                            and m.kwargs.get("reason") == TWO_GPUS)]
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
