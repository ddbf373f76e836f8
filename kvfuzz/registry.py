"""Finding allocators by name: an entry point an installed package registers, ``MODULE:FACTORY``, or ``zoo:NAME``.

Every command, the pytest plugin and trace replay load allocators through :func:`load_factory`, and check what the
factory builds with :func:`probe_allocator` before any work starts. A name read from a trace is checked against an
:class:`AllocatorTrust` first: loading ``MODULE:FACTORY`` imports the module and calls the factory, so a trace
from elsewhere could otherwise run any importable callable.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from typing import Callable

import attrs

from kvfuzz.allocator.protocol import CORE_METHODS, DECLARED_METHODS, AllocatorProtocol
from kvfuzz.allocator.types import Capabilities, PoolSpec

AllocatorFactory = Callable[[PoolSpec], AllocatorProtocol]
"""Builds one allocator for the pool geometry kvfuzz asks for."""

DEFAULT_ALLOCATOR = "kvfuzz.allocator.paged:paged_allocator"
ALLOCATOR_ENTRY_POINTS = "kvfuzz.allocators"


ACCEPTED_FORMS = "MODULE:FACTORY (e.g. kvfuzz.allocator.paged:paged_allocator), zoo:NAME, or a registered name"


OWN_ALLOCATOR_MODULES = ("kvfuzz.allocator", "kvfuzz.adapters", "kvfuzz.zoo")
"""kvfuzz's own allocators, its adapters of engine libraries and its zoo of broken allocators (a campaign's trace of
``kvfuzz.zoo.combined:...`` names its factory so): a trace naming a factory in these modules runs only code kvfuzz
ships (and the engine library the adapter wraps)."""

_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class UntrustedAllocator(Exception):
    """A trace names an allocator that replaying it would import and call, and nothing trusts it: the message is one
    line naming the module and the callable; the caller adds how its user can trust it."""


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


@attrs.frozen
class AllocatorTrust:
    """Which allocators a trace may name and have imported and called by its replay. Always: a ``zoo:`` name, a name
    registered in the ``kvfuzz.allocators`` entry-point group (or the ``MODULE:FACTORY`` such an entry point names),
    a factory in kvfuzz's own allocator and adapter modules (:data:`OWN_ALLOCATOR_MODULES`), and a bare name that
    is not registered (nothing is imported for it: loading it fails). Besides: ``MODULE:FACTORY`` whose module is
    one of ``modules`` or inside one (the prefixes a project lists for its own corpus), and anything when
    ``everything`` (the user said they trust the trace). An allocator the user names on the command line is not a
    trace's and is never checked."""

    modules: tuple[str, ...] = ()
    everything: bool = False

    def __attrs_post_init__(self) -> None:
        bad = [prefix for prefix in self.modules if not _MODULE_NAME.fullmatch(prefix)]
        if bad:
            raise ValueError(f"trusted allocator modules: {bad[0]!r} is not a dotted module name (e.g. mypackage.kv)")

    def check(self, spec: str) -> None:
        """Nothing if replaying a trace that names ``spec`` may load it; else :class:`UntrustedAllocator`."""
        module, _, attribute = spec.partition(":")
        if self.everything or spec.startswith("zoo:") or not attribute:
            return
        registered = registered_allocators()
        if spec in registered or spec in {entry.value for entry in registered.values()}:
            return
        if _within(module, OWN_ALLOCATOR_MODULES + self.modules):
            return
        raise UntrustedAllocator(
            f"the trace names the allocator {spec!r}: replaying it would import the module {module!r} and call its "
            f"{attribute!r}, which is not a registered allocator, a zoo: name or kvfuzz's own, and is not trusted"
        )


class AllocatorNotFound(LookupError):
    """``--allocator`` named something that cannot be imported or called."""


class AllocatorUnusable(ValueError):
    """The factory ``--allocator`` names loads, but does not build an allocator kvfuzz can drive: it raises, has the
    wrong signature, returns something without the contract's attributes, or ignores the pool it was asked for."""


def registered_allocators() -> dict[str, importlib.metadata.EntryPoint]:
    """Allocators that installed packages register in the ``kvfuzz.allocators`` entry-point group, by name."""
    return {entry.name: entry for entry in importlib.metadata.entry_points(group=ALLOCATOR_ENTRY_POINTS)}


def load_factory(spec: str) -> AllocatorFactory:
    """A name registered in the ``kvfuzz.allocators`` entry-point group -> its factory; ``package.module:factory``
    (importable from the environment or the current directory) -> the factory; ``zoo:Name`` -> a broken
    allocator from the zoo. Anything that fails (a module whose import raises or exits included; only a
    ``KeyboardInterrupt`` passes through) is :class:`AllocatorNotFound`, one line naming ``spec``."""
    registered = registered_allocators()
    if spec in registered:
        try:
            return registered[spec].load()
        except KeyboardInterrupt:
            raise
        except BaseException as error:  # any import failure of a plugin (a sys.exit included) is reported the same way
            raise AllocatorNotFound(
                f"--allocator {spec!r}: the registered entry point failed to load: {error}"
            ) from error
    if spec.startswith("zoo:"):
        from kvfuzz.zoo import variant

        try:
            return variant(spec[4:]).factory()
        except KeyError as error:
            raise AllocatorNotFound(f"--allocator {spec!r}: {error.args[0]}") from error
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        names = ", ".join(sorted(registered)) or "none"
        raise AllocatorNotFound(
            f"--allocator {spec!r}: no allocator is registered under that name (registered: {names}); "
            f"name one as {ACCEPTED_FORMS}"
        )
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # as `python -m` would: modules in the current directory are importable
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AllocatorNotFound(f"--allocator {spec!r}: cannot import {module_name!r}: {error}") from error
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # a module that fails or exits while importing is reported, not a traceback
        raise AllocatorNotFound(
            f"--allocator {spec!r}: importing {module_name!r} raised {type(error).__name__}: {error}"
        ) from error
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise AllocatorNotFound(f"--allocator {spec!r}: {module_name} has no callable {attribute!r}")
    return factory


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def probe_allocator(spec: str, factory: AllocatorFactory, pool: PoolSpec) -> AllocatorProtocol:
    """Build one allocator with ``factory`` for ``pool`` and check that kvfuzz can drive it, before any work: the
    factory takes one argument and returns an object with the contract's attributes (``capabilities`` a
    :class:`~kvfuzz.allocator.Capabilities`, the methods it declares) and the geometry it was asked for
    (``block_size`` and ``num_blocks`` as given; ``num_host_blocks`` as given or 0).

    Returns the allocator, never driven. Raises :class:`AllocatorNotFound` when the factory needs a package that is
    not installed (it raised ImportError), :class:`AllocatorUnusable` otherwise (whatever it raised, ``SystemExit``
    and other ``BaseException``s included; only a ``KeyboardInterrupt`` passes through); either message is one line
    that names ``spec``."""
    where = f"--allocator {spec!r}"
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check before calling it
        signature = None
    if signature is not None:
        try:
            signature.bind(pool)
        except TypeError as error:
            raise AllocatorUnusable(
                f"{where}: the factory must take one argument, a PoolSpec; its signature is {signature} ({error})"
            ) from None
    try:
        allocator = factory(pool)
    except ImportError as error:
        text = " ".join(str(error).split()) or type(error).__name__
        raise AllocatorNotFound(f"{where}: the factory needs a package that is not installed: {text}") from error
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # whatever the factory raised (a sys.exit, a pytest.skip) is reported in one line
        raise AllocatorUnusable(f"{where}: the factory raised {_one_line(error)} when called with {pool}") from error
    if allocator is None:
        raise AllocatorUnusable(f"{where}: the factory returned None, not an allocator")
    built = f"{where}: the factory returned a {type(allocator).__name__}"
    capabilities = getattr(allocator, "capabilities", None)
    if not isinstance(capabilities, Capabilities):
        found = "none" if capabilities is None else f"a {type(capabilities).__name__}"
        raise AllocatorUnusable(
            f"{built} without 'capabilities' (a kvfuzz.allocator.Capabilities; found {found}): see docs/contract.md"
        )
    wanted = [*CORE_METHODS]
    for capability, methods in DECLARED_METHODS.items():
        if getattr(capabilities, capability):
            wanted += methods
    missing = [name for name in wanted if not callable(getattr(allocator, name, None))]
    if missing:
        raise AllocatorUnusable(f"{built} without the method(s) {', '.join(missing)} (see docs/contract.md)")
    geometry = []
    for name in ("block_size", "num_blocks", "num_host_blocks"):
        asked = getattr(pool, name)
        got = getattr(allocator, name, None)
        if got != asked and not (name == "num_host_blocks" and got == 0):
            geometry.append(f"{name} {got!r} (asked for {asked})")
    if geometry:
        raise AllocatorUnusable(
            f"{built} with {', '.join(geometry)}: an allocator must report the pool it was asked for "
            "(num_host_blocks may be 0)"
        )
    return allocator


def builds(spec: str, factory: AllocatorFactory, pool: PoolSpec) -> bool:
    """Whether ``factory`` builds an allocator kvfuzz can drive for ``pool``."""
    try:
        probe_allocator(spec, factory, pool)
    except (AllocatorUnusable, AllocatorNotFound):
        return False
    return True
