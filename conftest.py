"""Suite-wide set-up. Without CUDA, Triton kernels run under Triton's CPU interpreter; the switch must be
set before triton is first imported, so it lives here rather than in one component's conftest."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
