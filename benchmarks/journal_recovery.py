"""Memory and time to recover a large journal (issue 45, item 8: a 316 MB journal took 1.2 GB to recover).

Writes a journal of a dead process of about ``--megabytes`` MB (default 316) into a temporary directory, in two
shapes: ``many``, programs of 21 ordinary calls one after another (a long run's journal before runs restarted theirs
past ``JOURNAL_LIMIT``), and ``one``, a single program of all those calls (no trace may hold it: recovery refuses
it); then recovers each in a fresh process (``kvfuzz.saved.journals.recover``) and prints its wall time and its
peak resident memory beside that of a process that only imports the module (the difference is what recovery took).
``--baseline PATH`` measures another checkout's recovery too, on the same files.

Usage: python benchmarks/journal_recovery.py [--megabytes N] [--baseline PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MEASURE = """
import resource, sys, time
from pathlib import Path
from kvfuzz.saved import journals
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
started = time.perf_counter()
handled = journals.recover(Path(sys.argv[1])) if sys.argv[1] else []
took = time.perf_counter() - started
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{took:.1f} {before / 1024:.0f} {after / 1024:.0f}")
"""


def write_journal(path: Path, shape: str, size: int) -> None:
    """A journal of pid 999999999 of about ``size`` bytes, of the given shape (``many`` or ``one``)."""
    from kvfuzz.engine.config import MachineConfig, config_json

    config = MachineConfig()
    header = {"format": "kvfuzz-journal/1", "pid": 999_999_999, "allocator": "kvfuzz", "config": config_json(config, 0)}
    admit = {"rule": "admit", "arguments": {"seq": "s0", "namespace": [], "system": [], "suffix": [1, 2, 3]}}
    program = json.dumps(admit) + "\n" + (json.dumps({"rule": "step", "arguments": {}}) + "\n") * 20
    with open(path, "w") as out:
        out.write(json.dumps(header) + "\n")
        written, example = 0, 0
        while written < size:
            if shape == "many" or example == 0:
                example += 1
                out.write(json.dumps({"example": example}) + "\n")
            out.write(program)
            written += len(program)


def measure(checkout: Path, directory: str) -> tuple[float, float, float]:
    """Recovery of ``directory`` (none when empty) by ``checkout``'s kvfuzz: seconds, peak MB before and after."""
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, directory],
        env=environment,
        cwd=tempfile.gettempdir(),  # not a checkout: ``-c`` puts the working directory first on the path
        capture_output=True,
        text=True,
        check=True,
    )
    took, before, after = done.stdout.split()
    return float(took), float(before), float(after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=int, default=316)
    parser.add_argument("--baseline", type=Path, help="another checkout of kvfuzz to measure on the same files")
    args = parser.parse_args()
    checkouts = [("this checkout", ROOT)] + ([("baseline", args.baseline)] if args.baseline else [])
    for shape in ("many", "one"):
        for label, checkout in checkouts:
            with tempfile.TemporaryDirectory() as directory:
                journal = Path(directory) / ".kvfuzz-journal-999999999.jsonl"
                write_journal(journal, shape, args.megabytes * 1_000_000)
                megabytes = journal.stat().st_size / 1e6
                took, before, after = measure(checkout, directory)
            print(
                f"{shape:>4} ({megabytes:.0f} MB journal), {label}: {took:.1f} s, peak memory {after:.0f} MB "
                f"({after - before:+.0f} MB over the import's {before:.0f} MB)"
            )


if __name__ == "__main__":
    main()
