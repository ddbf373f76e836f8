"""The configuration of one kvfuzz machine: pool geometry, model shape and attention kernel."""

from __future__ import annotations

from typing import Any, Optional

import attrs
import torch

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.kernels import KERNEL_NAMES
from kvfuzz.reference.content import ModelShape

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The dtypes kvfuzz runs its pools in, by the names traces and the command line use."""


@attrs.frozen
class MachineConfig:
    """Pool geometry, model shape, and the attention kernel invariant 2 runs (see :mod:`kvfuzz.kernels`). The
    defaults keep the pool small enough that refusals happen often."""

    block_size: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    num_blocks: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    num_host_blocks: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    shape: ModelShape = ModelShape()
    kernel: str = attrs.field(default="gather", validator=attrs.validators.in_(KERNEL_NAMES))
    # The in-flight window W asked of the allocator's factory (PoolSpec.inflight_window): None leaves the factory's
    # own; a replayed trace asks for the W it recorded.
    inflight_window: Optional[int] = attrs.field(
        default=None, validator=attrs.validators.optional(attrs.validators.ge(0))
    )

    def pool_spec(self) -> PoolSpec:
        return PoolSpec(self.block_size, self.num_blocks, self.num_host_blocks, self.inflight_window)


def config_json(config: MachineConfig, inflight_window: Optional[int]) -> dict[str, Any]:
    """A machine configuration as a trace (and a journal's header) records it."""
    shape = config.shape
    dtype = next(name for name, value in DTYPES.items() if value == shape.dtype)
    fields = {
        "block_size": config.block_size,
        "num_blocks": config.num_blocks,
        "num_host_blocks": config.num_host_blocks,
        "inflight_window": inflight_window,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "num_query_heads": shape.num_query_heads,
        "head_dim": shape.head_dim,
        "dtype": dtype,
        "device": shape.device,
    }
    # The default kernel is left out, so traces (and their digests) from before kernels existed stay the same.
    return fields if config.kernel == "gather" else {**fields, "kernel": config.kernel}
