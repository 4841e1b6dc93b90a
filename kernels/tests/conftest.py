"""Kernel tests run on the CPU everywhere; Triton kernels run there under Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported. Where CUDA exists the kernels are
compiled for it instead, and the CPU cases keep to the torch and dma implementations.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hybridkv_kernels import available_impls  # noqa: E402


@pytest.fixture(params=available_impls("cpu"))
def cpu_impl(request) -> str:
    """Every implementation that runs plans on CPU tensors here."""
    return request.param


def pytest_collection_modifyitems(config, items):
    """Skip CUDA-marked tests on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
