"""Factories for kvfuzz's correct allocator in the configurations the tests drive."""

from __future__ import annotations

import attrs

from kvfuzz.allocator import PagedAllocator, PoolSpec


def make_allocator(window: int = 0, prefix_caching: bool = True, introspection: bool = True,
                   reserved_blocks: int = 0):
    """A factory for kvfuzz's correct allocator with the given options."""

    def factory(spec: PoolSpec) -> PagedAllocator:
        allocator = PagedAllocator(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=window,
                                   prefix_caching=prefix_caching, reserved_blocks=reserved_blocks)
        if not introspection:
            allocator.capabilities = attrs.evolve(allocator.capabilities, introspection=False)
        return allocator

    factory.__name__ = f"paged_w{window}{'' if prefix_caching else '_nocache'}{'' if introspection else '_opaque'}"
    return factory
