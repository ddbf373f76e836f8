"""Torch's intra-op threads, set for kvfuzz's work: every command that drives an engine runs under
:func:`single_threaded_torch`."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def single_threaded_torch() -> Iterator[None]:
    """kvfuzz's tensors are tiny: intra-op threads cost more than they save (attention is ~15x slower on two
    threads than on one on a 2-core machine), so a run uses one thread and restores the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
