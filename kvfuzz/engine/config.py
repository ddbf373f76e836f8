"""The configuration of one kvfuzz machine: pool geometry, model shape and attention kernel."""

from __future__ import annotations

import attrs

from kvfuzz.allocator.types import PoolSpec
from kvfuzz.kernels import KERNEL_NAMES
from kvfuzz.reference.content import ModelShape


@attrs.frozen
class MachineConfig:
    """Pool geometry, model shape, and the attention kernel invariant 2 runs (see :mod:`kvfuzz.kernels`). The
    defaults keep the pool small enough that refusals happen often."""

    block_size: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    num_blocks: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    num_host_blocks: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    shape: ModelShape = ModelShape()
    kernel: str = attrs.field(default="gather", validator=attrs.validators.in_(KERNEL_NAMES))

    def pool_spec(self) -> PoolSpec:
        return PoolSpec(self.block_size, self.num_blocks, self.num_host_blocks)
