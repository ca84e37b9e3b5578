"""Set before any test module imports Triton: without a GPU its kernels run under Triton's
interpreter on CPU tensors. A kernel module imported before this was set would keep
compiled-mode helpers, which the interpreter cannot call."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
