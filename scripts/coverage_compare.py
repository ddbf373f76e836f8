"""A campaign's coverage of the engine beside its own tests' (issue 42's comparison), file by file: each side's
figure, their union, the points each reached alone, and the functions where the tests reach the most that the
campaign does not. The same measurer counts both sides (kvfuzz.coverage), so the figures compare.

    PYTHONPATH=. VLLM_ENV/bin/python scripts/vllm_tests_coverage.py --sdist vllm-0.33.0.tar.gz --json tests.json
    VLLM_ENV/bin/python -m kvfuzz campaign --scheduler vllm-v1 --duration 600 --guided --json > campaign.json
    python scripts/coverage_compare.py tests.json campaign.json

What the docs leave out of scope (multimodal encoder inputs: whole functions, and the branches of the others that run
only for them) is left out of both sides unless ``--keep-all``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvfuzz.coverage.compare import ComparisonError, Measurement, compare
from kvfuzz.coverage.scope import CORE_FILES, LEFT_OUT


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="the JSON of scripts/vllm_tests_coverage.py --json")
    parser.add_argument("campaign", type=Path, help="the JSON of kvfuzz campaign --coverage --json")
    parser.add_argument("--scheduler", default="vllm-v1", choices=sorted(CORE_FILES), help="the target measured")
    parser.add_argument("--all-files", action="store_true", help="every file either side reached, not the core five")
    parser.add_argument("--keep-all", action="store_true", help="keep the functions the docs leave out of scope")
    parser.add_argument("--functions", type=int, default=15, metavar="N", help="the N widest gaps by function")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the comparison as JSON")
    args = parser.parse_args(argv)
    try:
        tests = Measurement.load("the tests", args.tests)
        campaign = Measurement.load("the campaign", args.campaign)
        files = CORE_FILES[args.scheduler]
        if args.all_files:
            files = tuple(sorted(set(tests.paths) | set(campaign.paths)))
        left_out = {} if args.keep_all else LEFT_OUT.get(args.scheduler, {})
        result = compare(tests, campaign, files, left_out)
    except ComparisonError as error:
        print(f"kvfuzz: {error}", file=sys.stderr)
        return 2
    header = f"{'points':>6} {'tests':>7} {'campaign':>8} {'union':>7} {'only tests':>10} {'only campaign':>13}"
    print(f"{'file':<46} {header}")
    for row in result.files:
        print(
            f"{row.name:<46} {row.points:>6} {row.percent(row.tests):6.1f}% {row.percent(row.campaign):7.1f}% "
            f"{row.percent(row.union):6.1f}% {row.tests_only:>10} {row.campaign_only:>13}"
        )
    if result.left_out or result.guarded:
        print(
            f"left out of both sides (the docs' 'What stays out'; --keep-all keeps them): {len(result.left_out)} "
            "functions, and the branches other functions run only for what stays out:"
        )
        for code in result.guarded:
            print(f"  {code}")
    gaps = result.widest_gaps(args.functions)
    if gaps:
        print(f"\nthe {len(gaps)} functions where the tests reach the most the campaign does not (points reached):")
        for gap in gaps:
            where = f"{gap.file.rsplit('/', 1)[-1]}:{gap.first_line} {gap.qualname}"
            print(f"  {where:<70} tests {gap.tests:>4}/{gap.points:<4} campaign {gap.campaign:>4}/{gap.points}")
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
