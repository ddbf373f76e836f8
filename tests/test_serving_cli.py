"""kvfuzz serve, capacity and ablate on the command line: bad input is one line and exit status 2 before any
replay; good input prints the report and the tables."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvfuzz.workload.budget
from kvfuzz.cli import main


@pytest.fixture
def no_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: object) -> None:
        raise AssertionError("a replay ran despite bad input")

    monkeypatch.setattr(kvfuzz.workload.budget.BudgetScheduler, "serve", refuse)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["serve", "poisson:0"], "expected poisson:RATE[:SEED] with a rate > 0"),
        (["serve", "poisson:x:1"], "expected poisson:RATE[:SEED]"),
        (["serve", "constructed:nope"], "no constructed workload named 'nope'"),
        (["serve", "missing.json"], "No such file"),
        (["serve", "constructed:uniform", "--token-budget", "0"], "--token-budget: must be >= 1"),
        (["serve", "constructed:uniform", "--policy", "random"], "--policy: invalid choice"),
        (["serve", "constructed:uniform", "--pool-positions", "100"], "is not a multiple of --block-size"),
        (["serve", "constructed:uniform", "--allocator", "nowhere:thing"], "nowhere"),
        (["serve", "constructed:uniform", "--step-ms", "-1"], "--step-ms: must be >= 0"),
        (["serve", "azure-csv:missing.csv"], "missing.csv"),
        (["serve", "azure-csv:x.csv", "--step-seconds", "0"], "--step-seconds: must be > 0"),
        (["capacity", "--rates", "0.1,x"], "--rates: 'x' is not a number"),
        (["capacity", "--rates", "0.1,0"], "--rates: a rate must be > 0"),
        (["capacity", "--block-sizes", "8,0"], "--block-sizes: a block size must be >= 1"),
        (["capacity", "--reserve", "50"], "--reserve 50 is shorter than the longest request (144 positions)"),
        (["capacity", "--pool-positions", "1000"], "--pool-positions 1000 is not a multiple of [16, 32, 64, 160]"),
        (["capacity", "--plot", "/no/such/dir/c.png"], "directory /no/such/dir does not exist"),
        (["capacity", "--ttft-p99", "0"], "--ttft-p99: must be > 0"),
        (["ablate", "poisson:0.5", "--reserve", "10"], "--reserve 10 is shorter than the longest request"),
        (["ablate", "constructed:nope"], "no constructed workload named 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], message: str, no_replay: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvfuzz: ") and captured.err.count("\n") == 1
    assert message in captured.err


def test_serve_prints_the_latency_table_and_the_cost_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "constructed:uniform", "--token-budget", "32", "--policy", "prefill-first"]) == 0
    out = capsys.readouterr().out
    assert "scheduling: prefill-first, token budget 32 per step (chunked prefill)" in out
    assert "provenance: constructed by kvfuzz.workload.constructed:uniform (seed 0)" in out
    assert "cost model (modelled, not measured): step time = 4 ms + 40 us x batched tokens" in out
    for row in ("TTFT (steps)", "TPOT (steps)", "E2E (steps)", "TTFT (s, modelled)", "E2E (s, modelled)"):
        assert row in out


def test_capacity_prints_one_row_per_layout_and_writes_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plot = tmp_path / "capacity.png"
    argv = ["capacity", "--requests", "6", "--rates", "0.5,8", "--block-sizes", "16,64", "--plot", str(plot)]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    table = out[out.index(next(line for line in out if line.startswith("layout"))) + 1 :]
    assert [line.split()[:2] for line in table[:3]] == [["paged", "B=16"], ["paged", "B=64"], ["reserve", "160"]]
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_capacity_plot_on_the_serving_page_is_drawn_from_the_table_shown_there() -> None:
    """scripts/capacity_plot.py runs the page's own capacity sample with --plot, and the page shows its image."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("capacity_plot", root / "scripts" / "capacity_plot.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (root / "docs" / "serving.md").read_text()
    assert f"<!-- sample: kvfuzz {' '.join(script.capacity_command())} -->" in page
    assert "](images/serving-capacity.png)" in page
    assert script.IMAGE.read_bytes().startswith(b"\x89PNG")
