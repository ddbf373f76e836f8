"""Which files are the code under test: for a scheduler target, the engine's packages the target runs; for an
allocator, its own module or package. Never kvfuzz's own code (the harness): a file of kvfuzz is in no scope.

A scope is a set of directories and files; the files measured are the Python files under them, and the files
reported are those the process has imported (an engine package's module the target never imports says nothing
about the target)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import attrs

import kvfuzz

KVFUZZ = os.path.realpath(Path(kvfuzz.__file__).parent)

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
        return tuple(sorted(file for file in found if not file.startswith(KVFUZZ + os.sep)))

    def imported(self, files: tuple[str, ...]) -> tuple[str, ...]:
        """Those of ``files`` whose module this process has imported."""
        loaded = set()
        for module in list(sys.modules.values()):
            name = getattr(module, "__file__", None)
            if name:
                loaded.add(os.path.realpath(name))
        return tuple(file for file in files if file in loaded)


def engine_scope(scheduler: str) -> Optional[Scope]:
    """The scope of scheduler target ``scheduler``; None when its engine is not installed here."""
    package, parts = SCOPES[scheduler]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(list(spec.submodule_search_locations)[0])
    return Scope(tuple(os.path.realpath(base / part) for part in parts if (base / part).exists()))


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
