"""Factories for kvfuzz's correct allocator in the configurations the tests drive, and small variants of it."""

from __future__ import annotations

import attrs

from kvfuzz.allocator import BlockCopy, PagedAllocator, PoolSpec


def make_allocator(window: int = 0, prefix_caching: bool = True, introspection: bool = True, reserved_blocks: int = 0):
    """A factory for kvfuzz's correct allocator with the given options."""

    def factory(spec: PoolSpec) -> PagedAllocator:
        allocator = PagedAllocator(
            spec.block_size,
            spec.num_blocks,
            spec.num_host_blocks,
            inflight_window=window,
            prefix_caching=prefix_caching,
            reserved_blocks=reserved_blocks,
        )
        if not introspection:
            allocator.capabilities = attrs.evolve(allocator.capabilities, introspection=False)
        return allocator

    factory.__name__ = f"paged_w{window}{'' if prefix_caching else '_nocache'}{'' if introspection else '_opaque'}"
    return factory


def declaring(cls: type, window: int = 0, **capabilities: object):
    """A factory for ``cls`` (kvfuzz's allocator or a variant of it) declaring ``capabilities`` on top of its own."""

    def factory(spec: PoolSpec) -> PagedAllocator:
        allocator = cls(spec.block_size, spec.num_blocks, spec.num_host_blocks, inflight_window=window)
        allocator.capabilities = attrs.evolve(allocator.capabilities, **capabilities)
        return allocator

    factory.__name__ = f"{cls.__name__}_{'_'.join(f'{k}_{v}' for k, v in capabilities.items())}"
    return factory


class CopyTailOnFork(PagedAllocator):
    """A correct allocator whose fork copies the parent's partial last block instead of sharing it."""

    def fork(self, parent, child):
        partial = len(self._running(parent, "fork").tokens) % self.block_size != 0
        if partial:
            self._check_room(1)
        super().fork(parent, child)
        if not partial:
            return None
        state = self._seqs[child]
        tail = state.table[-1]
        (fresh,) = self._pool.allocate(1)
        self._pool.release(tail)
        state.table[-1] = fresh
        return [BlockCopy(tail, fresh)]
