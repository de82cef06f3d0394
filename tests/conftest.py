import pytest
import torch

from ranks import sharing_one_gpu

if sharing_one_gpu() and torch.cuda.device_count() == 1:
    # tests/ranks.py runs NCCL ranks on the one GPU as separate hosts: the 2-GPU tests may run.
    torch.cuda.device_count = lambda: 2


def pytest_collection_modifyitems(config, items):
    """GPU tests skip (with a reason) where CUDA is absent, instead of failing."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
