"""The gather kernel: copy each sequence's K/V rows out of the pools through its block table, then run the reference's
own :func:`~kvfuzz.reference.attention.attend` on them. Same function, same zero padding as the contiguous side, so
correct block tables give results equal bit for bit."""

from __future__ import annotations

from typing import Optional

import torch

from kvfuzz.kernels.base import PagedBatch, Tolerance
from kvfuzz.reference.attention import attend


class GatherKernel:
    """Gather through the block tables, then :func:`attend`; held to bitwise equality."""

    name = "gather"

    def tolerance(self, dtype: torch.dtype) -> Optional[Tolerance]:
        return None

    def attend(self, batch: PagedBatch) -> torch.Tensor:
        keys, values = self.gathered(batch)
        return attend(batch.queries, keys, values, torch.tensor(batch.window_lengths()))

    def gathered(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V that :meth:`attend` reads, ``[S, N, L, Hkv, D]``: each row's positions through its block
        table, zeros past its window's end (N the longest window)."""
        device = batch.keys.device
        lengths = batch.window_lengths()
        longest = max(lengths)
        # One index tensor built from Python lists: padding reads row 0, which the mask below replaces by zeros.
        rows = [batch.slots(row) for row in range(len(batch.seqs))]
        index = torch.tensor([slots + [0] * (longest - len(slots)) for slots in rows], dtype=torch.int64)
        valid = torch.arange(longest).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        valid = valid.to(device)[:, :, None, None, None]
        index = index.to(device)
        return torch.where(valid, batch.keys[index], 0), torch.where(valid, batch.values[index], 0)
