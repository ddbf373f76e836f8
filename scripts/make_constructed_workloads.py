"""Regenerate workloads/constructed/*.json from kvfuzz.workload.constructed (a test checks they match)."""

from pathlib import Path

from kvfuzz.workload.constructed import write_constructed

if __name__ == "__main__":
    for path in write_constructed(Path(__file__).resolve().parent.parent / "workloads" / "constructed"):
        print(f"wrote {path}")
