"""Whether torch can be imported here. Every command that drives tensors asks before any work, so that a machine
without torch, or with a build that cannot load (a CUDA build without its driver), gets one line saying what to
install instead of a traceback; commands that need no tensors, ``--help`` and usage errors never import it."""

from __future__ import annotations

from typing import Optional

INSTALL_TORCH = "pip install torch (any torch>=2.2; the CPU build is enough, see README.md)"


def torch_unavailable() -> Optional[str]:
    """None when ``import torch`` works here; else why not, in one line (the exception's type and message)."""
    try:
        import torch  # noqa: F401 -- only whether it imports
    except Exception as error:  # noqa: BLE001 -- an ImportError, or an OSError or RuntimeError of a broken build
        text = " ".join(str(error).split())
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return None
