"""benchmarks/first_failure.py: bad input refused before any campaign, and how campaigns that found nothing count."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CHECKOUT = str(BENCHMARKS.parent)


def first_failure() -> ModuleType:
    spec = importlib.util.spec_from_file_location("first_failure", BENCHMARKS / "first_failure.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--baseline", CHECKOUT, "--variants", "NoSuchVariant"], "no zoo variant named NoSuchVariant"),
        (["--baseline", "/nonexistent-checkout"], "/nonexistent-checkout is not a kvfuzz checkout"),
        (["--baseline", CHECKOUT, "--seeds", "0"], "--seeds and --workers must be at least 1"),
        (["--baseline", CHECKOUT, "--duration", "0"], "--duration positive"),
    ],
)
def test_bad_input_is_one_line_and_status_2_before_any_campaign(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = first_failure()
    ran: list[object] = []
    monkeypatch.setattr(module, "run_campaign", lambda *args: ran.append(args))
    with pytest.raises(SystemExit) as exited:
        module.main(arguments)
    assert exited.value.code == 2 and ran == []
    out, err = capsys.readouterr()
    assert out == "" and said in err and len(err.strip().splitlines()) == 1


def test_a_campaign_that_found_nothing_counts_as_later_than_any_that_did() -> None:
    module = first_failure()
    assert module.median_or_none([3.0, None, 1.0]) == 3.0
    assert module.median_or_none([3.0, None, None]) is None
    assert module.median_or_none([None]) is None
    assert module.seconds_text(None, 60.0) == "not found in 60 s"
    assert module.ratio_text(13.3, None) == "-" and module.ratio_text(12.0, 4.0) == "3.00"
