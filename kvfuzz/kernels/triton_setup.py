"""What the engines' Triton kernels share: Triton's interpreter on CPU tensors, and importing the engine's module.

Triton compiles its kernels for a GPU; on a CPU-only machine its interpreter (``TRITON_INTERPRET=1``) runs the same
kernel source on CPU tensors, one program at a time in NumPy. Triton reads that variable when a module decorates its
kernels with ``@triton.jit``, that is when the engine's package is imported, so it must be set before: a kernel's
entry in :data:`kvfuzz.kernels.PREPARE` calls :func:`interpret_on_cpu`, which ``kvfuzz run``, ``serve``, ``replay``
and the pytest plugin run before they load the allocator. Pools on a GPU leave the variable alone: Triton compiles.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import torch

from kvfuzz.kernels.base import KernelUnavailable
from kvfuzz.reference.content import ModelShape

INTERPRET = "TRITON_INTERPRET"
"""The environment variable that makes ``@triton.jit`` kernels run in Triton's interpreter."""

INTERPRETER_DTYPES = (torch.float32, torch.float16)
"""Pool dtypes the interpreter runs on CPU. bfloat16 is not one: NumPy has no bfloat16, and Triton 3.9's interpreter
runs SGLang's kernels on bfloat16 pools without complaint but returns garbage (outputs near 8e8 where they lie in
[-1, 1])."""


def on_cpu(shape: ModelShape) -> bool:
    return not shape.device.startswith("cuda")


def interpreting() -> bool:
    return os.environ.get(INTERPRET) == "1"


def interpret_on_cpu(kernel: str, shape: ModelShape) -> None:
    """Before Triton is imported, choose its interpreter when the pools of ``shape`` are on the CPU; raises
    :class:`KernelUnavailable` when that is too late (Triton already imported without it) or when the interpreter
    cannot run the pools' dtype. Idempotent: a kernel's factory calls it again, for callers that made the kernel
    without running :data:`~kvfuzz.kernels.PREPARE` first."""
    if not on_cpu(shape):
        return
    check_interpreter_dtype(kernel, shape)
    if interpreting():
        return
    if "triton" in sys.modules:
        raise KernelUnavailable(
            f"kernel {kernel!r} runs on CPU in Triton's interpreter, but Triton was imported before {INTERPRET}=1 "
            f"was set: set {INTERPRET}=1 in the environment before starting"
        )
    os.environ[INTERPRET] = "1"


def check_interpreter_dtype(kernel: str, shape: ModelShape) -> None:
    """Refuse a pool dtype Triton's interpreter cannot run on the CPU."""
    if on_cpu(shape) and shape.dtype not in INTERPRETER_DTYPES:
        names = " or ".join(str(dtype).removeprefix("torch.") for dtype in INTERPRETER_DTYPES)
        raise KernelUnavailable(
            f"kernel {kernel!r} on CPU runs in Triton's interpreter, which cannot run "
            f"{str(shape.dtype).removeprefix('torch.')} pools: use {names}"
        )


def import_engine_module(kernel: str, module: str, needs: str, install: str) -> Any:
    """The engine's ``module`` for ``kernel``, or :class:`KernelUnavailable` in one line when it (or anything it
    imports) cannot be imported: which kernel, what it ``needs``, why the import failed, and how to ``install`` it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        reason = " ".join(str(error).split())
        raise KernelUnavailable(
            f"kernel {kernel!r} needs {needs}: cannot import {module} ({reason}); {install}"
        ) from None
