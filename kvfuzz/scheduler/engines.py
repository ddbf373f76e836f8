"""The engines a scheduler target drives and the versions of each that kvfuzz is tested on (the version matrix:
scripts/third_party/ builds each version's environment and .ci/run runs the engine tests in each). Before any example,
:func:`engine_problem` says in one line why a target cannot run here: its engine is missing, or its installed version
is not a tested one (unless the user runs it anyway, ``--untested-engine``: then :func:`untested_warning` is printed,
and the traces record the installed version as always). What differs between tested vLLM releases is
:mod:`kvfuzz.scheduler.vllm_release`'s."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Optional

import attrs


def installed_version(package: str) -> str:
    """The installed version of ``package`` (``vllm``, ``sglang``), read without importing it; ``unknown`` when it
    has none."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@attrs.frozen
class Engine:
    """One engine a scheduler target drives."""

    package: str  # its distribution and import name
    name: str  # as a person writes it
    recipe: str  # scripts/third_party/RECIPE.sh builds its environments
    tested: tuple[str, ...]  # the versions kvfuzz is tested on, oldest first

    def installed(self) -> Optional[str]:
        """The installed version (None: not installed; checked without importing it)."""
        if importlib.util.find_spec(self.package) is None:
            return None
        return installed_version(self.package)

    def tested_text(self) -> str:
        """``0.33.0 and 0.34.0``."""
        *first, last = self.tested
        return f"{', '.join(first)} and {last}" if first else last


VLLM = Engine("vllm", "vLLM", "vllm", ("0.33.0", "0.34.0"))
SGLANG = Engine("sglang", "SGLang", "sglang", ("0.5.22", "0.5.23"))
ENGINES = {"vllm-v1": VLLM, "sglang": SGLANG}
"""Each scheduler target's engine, by ``--scheduler`` name."""


def engine_problem(
    scheduler: str, untested_engine: bool, asked: str = "--scheduler", anyway: str = "--untested-engine"
) -> Optional[str]:
    """Why ``scheduler`` cannot run here, in one line (None: it can): its engine is not installed, or its version is
    not a tested one and ``untested_engine`` was not given. ``asked`` and ``anyway`` are the options of the command
    that asks (the pytest plugin's are ``--kvfuzz-scheduler`` and ``--kvfuzz-untested-engine``)."""
    engine = ENGINES[scheduler]
    version = engine.installed()
    if version is None:
        return (
            f"{asked} {scheduler} needs {engine.name} (tested: {engine.tested_text()}), which is not installed "
            f"here; build its environment with scripts/third_party_env.sh {engine.recipe}@VERSION"
        )
    if version not in engine.tested and not untested_engine:
        return (
            f"{asked} {scheduler}: {engine.name} {version} is installed, and kvfuzz is tested on "
            f"{engine.name} {engine.tested_text()} only; run it anyway with {anyway} (a failure may then be "
            "kvfuzz not speaking this version)"
        )
    return None


def untested_warning(scheduler: str) -> Optional[str]:
    """The warning line of a run on an untested engine version (None: a tested one)."""
    engine = ENGINES[scheduler]
    version = engine.installed()
    if version is None or version in engine.tested:
        return None
    return (
        f"kvfuzz: warning: {engine.name} {version} is not a version kvfuzz is tested on ({engine.tested_text()}); "
        "its findings and harness errors may be kvfuzz not speaking it; its traces record the version"
    )
