"""Every workload carries its provenance; the Azure LLM inference trace importer; and tables that refuse to mix
constructed and recorded evidence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfuzz.cli import main
from kvfuzz.workload.arrivals import poisson
from kvfuzz.workload.constructed import constructed
from kvfuzz.workload.format import FORMAT, WorkloadError, load_workload, parse_workload
from kvfuzz.workload.importers import AZURE_FORMAT, import_azure_csv
from kvfuzz.workload.provenance import MixedEvidence, Provenance, one_kind

AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.0000000,879,20
2023-11-16 18:15:48.2500001,91,1
"""


def test_the_azure_trace_becomes_a_recorded_workload_with_arrivals_in_steps(tmp_path: Path) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE)
    workload = import_azure_csv(path, step_seconds=0.5)
    assert workload.origin == "recorded"
    assert workload.source == Provenance("recorded", source=str(path), trace_format=AZURE_FORMAT)
    # seconds after the first request (18:15:46.680590), over 0.5 s per step, rounded down
    got = [(request.id, request.arrival, len(request.prompt), request.output_len) for request in workload.requests]
    assert got == [("line2", 0, 374, 44), ("line4", 0, 879, 20), ("line5", 3, 91, 1), ("line3", 8, 396, 109)]
    assert [request.id for request in import_azure_csv(path, 0.5, max_requests=2).requests] == ["line2", "line3"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:15:46,1,1\n", "expected the header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "holds no requests"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1\n", "line 2: expected 3 columns"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,0\n", "line 2: GeneratedTokens must be"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,12,3\n", "line 2: TIMESTAMP 'yesterday'"),
    ],
)
def test_a_malformed_azure_trace_is_refused_naming_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(WorkloadError, match=message):
        import_azure_csv(path, 0.5)


def test_constructed_workloads_name_their_generator_and_seed() -> None:
    assert constructed("uniform", seed=3).source == Provenance(
        "constructed", generator="kvfuzz.workload.constructed:uniform", seed=3
    )
    assert poisson(0.5, 7).source.describe() == "constructed by kvfuzz.workload.arrivals:poisson (seed 7)"
    shipped = load_workload(Path(__file__).resolve().parent.parent / "workloads" / "constructed" / "uniform.json")
    assert shipped.source.generator == "kvfuzz.workload.constructed:uniform" and shipped.source.seed == 0


def test_a_file_without_provenance_keeps_its_origin_and_one_that_contradicts_it_is_refused() -> None:
    body = {
        "format": FORMAT,
        "origin": "recorded",
        "requests": [{"id": "a", "arrival": 0, "prompt_len": 1, "output_len": 1}],
    }
    assert parse_workload(body).source == Provenance("recorded")
    with pytest.raises(WorkloadError, match="contradicts origin 'recorded'"):
        parse_workload({**body, "provenance": {"kind": "constructed", "generator": "x"}})
    with pytest.raises(WorkloadError, match="provenance 'seed' must be an integer"):
        parse_workload({**body, "provenance": {"kind": "recorded", "seed": "x"}})


def test_tables_refuse_to_mix_constructed_and_recorded_evidence() -> None:
    assert one_kind([Provenance("constructed"), Provenance("constructed", seed=1)], "t") == "constructed"
    with pytest.raises(MixedEvidence, match="refusing to put constructed and recorded workloads in one table"):
        one_kind([Provenance("constructed"), Provenance("recorded")], "t")


def test_kvfuzz_serve_reads_an_azure_trace_and_says_where_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "azure.csv"
    path.write_text(AZURE.replace("879", "87").replace("396", "39").replace("374", "37"))
    assert main(["serve", f"azure-csv:{path}", "--step-seconds", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["provenance"] == {"kind": "recorded", "source": str(path), "trace_format": AZURE_FORMAT}
    assert report["replay"]["finished"] == 4
    path.write_text("not,a,trace\n")
    assert main(["serve", f"azure-csv:{path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvfuzz: ") and "not an Azure LLM inference trace" in err and err.count("\n") == 1
