"""Which files are the code under test: for a scheduler target, the engine's packages the target runs; for an
allocator, the engine package an adapter drives (the adapter module's ``CODE_UNDER_TEST``), kvfuzz's allocator
package for kvfuzz's own allocators and the zoo's, else the factory's own module or package. Never the harness: a
file of kvfuzz outside its allocators (``OWN_ALLOCATORS``) is in no scope.

A scope is a set of directories and files; the files measured are the Python files under them, and the files
reported are those the process has imported (an engine package's module the target never imports says nothing
about the target)."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any, Callable, Optional

import attrs

import kvfuzz

KVFUZZ = os.path.realpath(Path(kvfuzz.__file__).parent)

OWN_ALLOCATORS = ("allocator", "zoo")
"""kvfuzz's packages that are code under test when a campaign runs them (its own allocators, and the zoo's broken
ones built on them: a zoo allocator's scope is both, a kvfuzz allocator's the first); the rest of kvfuzz is the
harness."""

SCOPES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm-v1": (
        "vllm",
        (
            "v1/core",  # the scheduler, the KV cache manager, its coordinator, block pool and single-type managers
            "v1/kv_offload",  # the offloading connector's manager and its CPU backend
            "distributed/kv_transfer/kv_connector/v1/offloading",  # the offloading connector's scheduler side
            "distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
            "distributed/kv_transfer/kv_connector/v1/base.py",
        ),
    ),
    "sglang": (
        "sglang",
        (
            "srt/mem_cache",  # the token pools, the allocators, the radix caches
            "srt/managers/schedule_policy.py",  # the admission of waiting requests (PrefillAdder, SchedulePolicy)
            "srt/managers/schedule_batch.py",  # requests and batches
        ),
    ),
}
"""Each scheduler target's scope: the engine's package, and the parts of it under test (relative to the package)."""

CORE_FILES: dict[str, tuple[str, ...]] = {
    "vllm-v1": (
        "vllm/v1/core/sched/scheduler.py",
        "vllm/v1/core/kv_cache_manager.py",
        "vllm/v1/core/block_pool.py",
        "vllm/v1/core/kv_cache_coordinator.py",
        "vllm/v1/core/single_type_kv_cache_manager.py",
    ),
    "sglang": (
        "sglang/srt/mem_cache/unified_radix_cache.py",
        "sglang/srt/mem_cache/memory_pool.py",
        "sglang/srt/mem_cache/allocator/paged.py",
        "sglang/srt/managers/schedule_policy.py",
        "sglang/srt/managers/schedule_batch.py",
    ),
}
"""The files of a target's scope its reports show first (package paths): the comparison with the engine's own tests
(scripts/coverage_compare.py), the blind-against-guided benchmark (benchmarks/coverage_guided.py)."""


@attrs.frozen
class LeftOut:
    """What of one file a target does not drive by design (the docs' "What stays out"), left out of both sides of a
    comparison with the engine's own tests: whole functions, by qualname (their nested functions with them), and, in
    the file's other functions, every ``if`` statement whose condition names one of ``guards``, with the block it
    guards (its ``else`` stays: :func:`~kvfuzz.coverage.static.guarded_lines`)."""

    functions: tuple[str, ...] = ()
    guards: frozenset[str] = frozenset()


ENCODER_GUARDS = frozenset(
    (
        "has_encoder_inputs",  # a request with multimodal inputs
        "mm_features",
        "encoder_inputs_to_schedule",  # what such a request schedules this step
        "external_load_encoder_input",
        "ec_connector",  # the encoder-cache connector (encoder outputs moved between instances)
        "ec_connector_output",
        "is_encoder_decoder",  # an encoder-decoder model (Whisper)
        "is_mm_encoder_only",  # an instance that only runs encoders
    )
)
"""The names a condition of vLLM's scheduler tests for multimodal encoder inputs: the branches of ``schedule()`` and
``update_from_output()`` they guard run only for a request that has such inputs, or on an encoder instance."""

LEFT_OUT: dict[str, dict[str, LeftOut]] = {
    "vllm-v1": {
        # multimodal encoder inputs (docs/scheduler-features.md, "What stays out"): a text-only model has none
        "vllm/v1/core/sched/scheduler.py": LeftOut(
            functions=(
                "Scheduler._reject_on_encoder_cache_embed_mismatch",
                "Scheduler._allocate_encoder_inputs",
                "Scheduler._try_schedule_encoder_inputs",
                "Scheduler._make_scheduled_encoder_input_stats",
                "Scheduler._get_encoder_input_updates",
                "Scheduler._free_encoder_inputs",
                "Scheduler._free_encoder_input",
                "Scheduler.reset_encoder_cache",
                "Scheduler._ec_transfer_pending",
                "Scheduler.get_ec_connector",
            ),
            guards=ENCODER_GUARDS,
        ),
    },
}
"""What of a target's scope kvfuzz does not drive, by design (the docs say why), by file: comparisons with the
engine's own tests may leave it out of both sides."""


@attrs.frozen
class Scope:
    """The code under test: the directories and files under which every Python file is measured."""

    roots: tuple[str, ...]  # real paths

    def files(self) -> tuple[str, ...]:
        """Every Python file of the scope (kvfuzz's own excluded)."""
        found: set[str] = set()
        for root in self.roots:
            path = Path(root)
            candidates = [path] if path.is_file() else sorted(path.rglob("*.py"))
            found |= {os.path.realpath(file) for file in candidates if file.suffix == ".py"}
        return tuple(sorted(file for file in found if not _harness(file)))

    def imported(self, files: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``files`` whose module this process has imported."""
        loaded = set()
        for module in list(sys.modules.values()):
            name = getattr(module, "__file__", None)
            if name:
                loaded.add(os.path.realpath(name))
        return tuple(file for file in files if file in loaded)


def _standard_library(file: str) -> bool:
    """Whether ``file`` is Python's own (a factory made by ``functools`` or ``operator`` says nothing of its code)."""
    path = os.path.realpath(file)
    return any(
        path.startswith(os.path.realpath(sysconfig.get_path(name)) + os.sep) for name in ("stdlib", "platstdlib")
    )


def _harness(file: str) -> bool:
    """Whether ``file`` is kvfuzz's own code outside its allocators."""
    if not file.startswith(KVFUZZ + os.sep):
        return False
    return Path(file).relative_to(KVFUZZ).parts[0] not in OWN_ALLOCATORS


def engine_scope(scheduler: str) -> Optional[Scope]:
    """The scope of scheduler target ``scheduler``; None when its engine is not installed here."""
    return package_scope(*SCOPES[scheduler])


def package_scope(package: str, parts: tuple[str, ...]) -> Optional[Scope]:
    """The ``parts`` (paths relative to it) of installed package ``package``; None when it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0])
    return Scope(tuple(os.path.realpath(base / part) for part in parts if (base / part).exists()))


def allocator_scope(factory: Callable[..., Any]) -> Scope:
    """The code under test of an allocator ``factory`` (see the module): an empty scope for a factory of kvfuzz's
    harness that declares none (llama.cpp's adapter: its allocator is C++), or whose module has no file."""
    while isinstance(factory, functools.partial):  # a partial's module is functools: the function's is the one
        factory = factory.func
    factory = inspect.unwrap(factory)
    module = sys.modules.get(getattr(factory, "__module__", None) or "")
    file = getattr(module, "__file__", None)
    if module is None or file is None or _standard_library(file):
        return Scope(())
    declared = getattr(module, "CODE_UNDER_TEST", None)
    if declared is not None:  # an adapter: the engine package whose allocator it drives
        return package_scope(*declared) or Scope(())
    path = os.path.realpath(file)
    if _harness(path):
        return Scope(())
    if path.startswith(KVFUZZ + os.sep):  # kvfuzz's own allocators; the zoo's, built on them, with them
        package = Path(path).relative_to(KVFUZZ).parts[0]
        return Scope(tuple(os.path.join(KVFUZZ, part) for part in OWN_ALLOCATORS[: OWN_ALLOCATORS.index(package) + 1]))
    return module_scope(path)


def module_scope(module_file: str) -> Scope:
    """An allocator's scope: its module's package directory, or the module alone when it is top-level."""
    path = Path(os.path.realpath(module_file))
    return Scope((str(path.parent) if (path.parent / "__init__.py").exists() else str(path),))


def display_name(path: str) -> str:
    """``path`` as a person names it: relative to the ``sys.path`` entry it is imported from (``vllm/v1/core/
    block_pool.py``), else as given."""
    best = ""
    for entry in sys.path:
        root = os.path.realpath(entry or ".")
        if path.startswith(root + os.sep) and len(root) > len(best):
            best = root
    return path[len(best) + 1 :] if best else path
