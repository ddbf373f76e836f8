"""Finding allocators by name: an entry point an installed package registers, ``MODULE:FACTORY``, or ``zoo:NAME``.

Every command, the pytest plugin and trace replay load allocators through :func:`load_factory`.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Callable

from kvfuzz.allocator.protocol import AllocatorProtocol
from kvfuzz.allocator.types import PoolSpec

AllocatorFactory = Callable[[PoolSpec], AllocatorProtocol]
"""Builds one allocator for the pool geometry kvfuzz asks for."""

DEFAULT_ALLOCATOR = "kvfuzz.allocator.paged:paged_allocator"
ALLOCATOR_ENTRY_POINTS = "kvfuzz.allocators"


class AllocatorNotFound(LookupError):
    """``--allocator`` named something that cannot be imported or called."""


def registered_allocators() -> dict[str, importlib.metadata.EntryPoint]:
    """Allocators that installed packages register in the ``kvfuzz.allocators`` entry-point group, by name."""
    return {entry.name: entry for entry in importlib.metadata.entry_points(group=ALLOCATOR_ENTRY_POINTS)}


def load_factory(spec: str) -> AllocatorFactory:
    """A name registered in the ``kvfuzz.allocators`` entry-point group -> its factory; ``package.module:factory``
    (importable from the environment or the current directory) -> the factory; ``zoo:Name`` -> a broken
    allocator from the zoo."""
    registered = registered_allocators()
    if spec in registered:
        try:
            return registered[spec].load()
        except Exception as error:  # noqa: BLE001 -- any import failure of a plugin is reported the same way
            raise AllocatorNotFound(
                f"--allocator {spec!r}: the registered entry point failed to load: {error}"
            ) from error
    if spec.startswith("zoo:"):
        from kvfuzz.zoo import variant

        try:
            return variant(spec[4:]).factory()
        except KeyError as error:
            raise AllocatorNotFound(str(error.args[0])) from error
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise AllocatorNotFound(f"--allocator {spec!r}: expected MODULE:FACTORY, e.g. {DEFAULT_ALLOCATOR}")
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as `python -m` would: modules in the current directory are importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AllocatorNotFound(f"--allocator {spec!r}: cannot import {module_name!r}: {error}") from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise AllocatorNotFound(f"--allocator {spec!r}: {module_name} has no callable {attribute!r}")
    return factory
