"""benchmarks/calls.py and its measuring process: bad input, the checks-off switch, and the attribution of time."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvfuzz.engine.checks.attention import AttentionCheck
from kvfuzz.engine.checks.cache import CacheSoundness
from kvfuzz.engine.checks.content import ContentChecks
from kvfuzz.engine.checks.results import ResultChecks

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def measure_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("calls_measure", BENCHMARKS / "calls_measure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--repeats", "0"], "--repeats must be at least 1, not 0"),
        (["--baseline", "/nonexistent-checkout"], "is not a checkout of kvfuzz"),
        (["--allocators", "kvfuzz,nope"], "unknown nope"),
        (["--profile", "--breakdown"], "not allowed with argument"),
    ],
)
def test_bad_input_is_one_line_and_status_2(arguments: list[str], said: str) -> None:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "calls.py"), *arguments], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_checks_off_replaces_the_checks_and_keeps_what_the_engine_reads() -> None:
    switch = measure_module().CheckSwitch()
    switched = {(cls.__name__, name) for cls, name, _ in switch.methods}
    assert ("AttentionCheck", "check") in switched and ("ContentChecks", "holds") in switched
    # These return what the engine goes on with: never switched off.
    assert ("CacheSoundness", "cache_hit") not in switched and ("ResultChecks", "block_table") not in switched
    original = AttentionCheck.check
    try:
        switch.set(False)
        assert AttentionCheck.check is not original and ContentChecks.holds.__name__ == "_skipped"
        assert CacheSoundness.cache_hit.__name__ == "cache_hit" and ResultChecks.block_table.__name__ == "block_table"
    finally:
        switch.set(True)
    assert AttentionCheck.check is original


def test_time_in_a_library_counts_for_it_and_what_it_calls_too(tmp_path: Path) -> None:
    """json stands for an engine's package: its Python code is library time, and so are the C functions it calls;
    a list comprehension of this file, entered from neither, is other time."""
    attribution = measure_module().Attribution(Path(json.__file__).parent, tmp_path / "kvfuzz")
    payload = [{"k": list(range(5000))} for _ in range(200)]  # json's C encoder does most of the work
    attribution.calibrate(calls=2000, runs=1)
    attribution.run(lambda: [json.dumps(item) for item in payload])
    seconds = attribution.estimates()
    assert seconds["library"] > 0 and seconds["adapter"] == seconds["kvfuzz"] == 0
    assert attribution.events["library"] > attribution.events["other"]
