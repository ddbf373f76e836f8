"""kvfuzz on a GPU, in one prepared run of under ten minutes: invariant 2 through every attention kernel that can run
there, on kvfuzz's allocators and through vLLM's v1 adapter, with steps/s on the GPU beside the same run on CPU.

    python scripts/gpu_check.py                 # on a CUDA machine: a budget of 540 s
    python scripts/gpu_check.py --device cpu    # the same script as a short dry run on CPU (CI runs it)

Three sections, each stopping at its share of ``--budget``:

1. ``pools``: ``kvfuzz run --device DEVICE`` as a user types it (the pools on the device, the gather kernel);
2. ``tolerance``: each available kernel against the reference on one batch of scattered tables, sliding-window starts
   and a KV-cache group of smaller blocks, printing the largest difference seen beside the kernel's tolerance (what
   docs/kernels.md's provisional GPU tolerances are to be measured by);
3. ``kernels``: ``kvfuzz run --kernel K --allocator A --device DEVICE --json`` for every available kernel K and
   allocator A, then the same run on CPU where K runs there, each a child process stopped at its share.

A kernel or allocator whose package is absent is reported as ``unavailable: <reason>``, never left out. The exit
status is 1 if any check failed or did not finish within its share, 0 otherwise; 2, with one line and before any
work, when ``--device cuda`` is asked for where torch sees no CUDA device. Packages the GPU machine lacks (FlashInfer)
are installed from wheels carried beside the repository before running it (docs/speed.md#gpu-figures).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import attrs

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ".kvfuzz/gpu-check-corpus"  # where a failing run's trace is saved, under ROOT (ignored by git and pytest)

KERNELS = ("gather", "flashinfer", "flashinfer-prefill", "vllm-triton", "sglang-triton", "flex", "flex-compiled")
"""The kernels checked, in this order (the slowest last); those this kvfuzz or this machine lacks are reported
unavailable."""

ALLOCATORS = {
    "kvfuzz": None,
    "kvfuzz-hybrid": None,
    "kvfuzz.adapters.vllm_v1:kv_cache_manager": "vllm",
    "kvfuzz.adapters.vllm_v1:kv_cache_manager_sliding_window": "vllm",
}
"""The allocators each kernel runs on, and the package each needs beyond kvfuzz (None: kvfuzz's own): plain tables,
KV-cache groups with a sliding window (kvfuzz-hybrid), and vLLM's block manager with and without one."""

CPU_BESIDE = "kvfuzz"
"""The allocator whose kernel runs are repeated on CPU, for steps/s side by side."""

SHAPE_ARGUMENTS: tuple[str, ...] = ("--block-size", "16", "--num-blocks", "64", "--layers", "2", "--kv-heads", "2")
SHAPE_ARGUMENTS += ("--query-heads", "8", "--head-dim", "64", "--dtype", "bfloat16")
"""The pools and model of the kernel runs: pages of 16 tokens, GQA of 4, head dim 64 in bfloat16 (FlashInfer's
kernels take no smaller head dim, nor float32)."""

SHARES = {"pools": 0.15, "tolerance": 0.25, "kernels": 0.6}
"""Each section's share of the budget; time a section leaves unused passes to the next."""


@attrs.frozen
class Check:
    """One line of the summary table."""

    section: str  # pools, tolerance or kernels
    allocator: str  # the allocator driven ("-" where none is)
    kernel: str  # invariant 2's kernel
    result: str  # "passed", "FAILED: ...", "incomplete: ..." or "unavailable: <reason>"
    device_rate: Optional[float] = None  # steps/s on the checked device
    cpu_rate: Optional[float] = None  # steps/s of the same run on CPU, where it ran there

    @property
    def bad(self) -> bool:
        return self.result.startswith(("FAILED", "incomplete"))


class Clock:
    """A section's deadline: what is left of its share, of which each of ``parts`` remaining runs gets an equal part."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds  # when the section must have stopped

    def share(self, parts: int) -> float:
        return max(0.0, self.deadline - time.monotonic()) / max(parts, 1)


def child_env() -> dict[str, str]:
    """The environment of the kvfuzz runs: this one as it was at start (kernels' preparations may change this
    process's), with this repository first on PYTHONPATH."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def kvfuzz_run(arguments: list[str], timeout: float, env: dict[str, str]) -> tuple[str, Optional[float]]:
    """``kvfuzz run --json ARGUMENTS`` in a child process: its result (as in :class:`Check`) and steps/s."""
    if timeout < 1:
        return "incomplete: no time left in its share", None
    command = [sys.executable, "-W", "ignore", "-m", "kvfuzz.cli", "run", "--json", "--corpus", CORPUS]
    try:
        done = subprocess.run(
            command + arguments, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
        )
    except subprocess.TimeoutExpired:
        return f"incomplete: stopped at its share of {timeout:.0f} s", None
    if done.returncode == 2:
        lines = done.stderr.strip().splitlines() or ["exit status 2"]
        return f"unavailable: {lines[-1].removeprefix('kvfuzz: ')}", None
    try:
        summary = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = " ".join(done.stderr.strip().splitlines()[-1:]) or f"exit status {done.returncode}"
        return f"FAILED: {tail}", None
    if summary["failed"]:
        return f"FAILED: {summary['invariant']} (trace in {CORPUS}/)", summary["steps_per_second"]
    return "passed", summary["steps_per_second"]


def kernel_unavailable(name: str, device: str) -> Optional[str]:
    """Why kernel ``name`` cannot run over the kernel runs' pools on ``device`` here (None: it can)."""
    from kvfuzz.allocator import paged_allocator
    from kvfuzz.engine.config import DTYPES, MachineConfig
    from kvfuzz.kernels import KernelUnavailable, make_kernel, prepare_kernel
    from kvfuzz.reference.content import ModelShape

    shape = ModelShape(2, 2, 8, 64, DTYPES["bfloat16"], device)
    try:
        prepare_kernel(name, shape)  # as kvfuzz run does, before the kernel's engine loads (kvfuzz.kernels.PREPARE)
        make_kernel(name, paged_allocator(MachineConfig(block_size=16, num_blocks=64, shape=shape).pool_spec()), shape)
    except KernelUnavailable as error:
        return str(error)
    return None


def pools_section(device: str, clock: Clock, examples: int, env: dict[str, str]) -> list[Check]:
    result, rate = kvfuzz_run(["--device", device, "--examples", str(examples)], clock.share(1), env)
    return [Check("pools", "kvfuzz", "gather", result, rate)]


def tolerance_section(device: str, kernels: list[str], clock: Clock) -> list[Check]:
    """Each kernel against the gather kernel (the reference's own attention) on one batch; the largest difference.

    It runs in this process, and is where each kernel first runs, so FlashInfer's and Inductor's compilations happen
    here: a kernel not started before the section's share is spent is reported incomplete, not run."""
    import torch

    from kvfuzz.allocator import paged_allocator
    from kvfuzz.allocator.types import NULL_BLOCK
    from kvfuzz.engine.config import MachineConfig
    from kvfuzz.kernels import GatherKernel, PagedBatch, compare, make_kernel
    from kvfuzz.reference.content import ModelShape

    shape = ModelShape(2, 2, 8, 64, torch.bfloat16, device)
    size, blocks = 16, 64
    generator = torch.Generator().manual_seed(0)

    def uniform(*dims: int) -> torch.Tensor:  # kvfuzz's K/V and queries lie in [-1, 1)
        return (torch.rand(dims, generator=generator) * 2 - 1).to(shape.dtype).to(device)

    tables = [(7, 3, 9, 40), (NULL_BLOCK, NULL_BLOCK, 5, 2, 11), (0,), (21, 22, 23, 24, 25, 26)]
    batch = PagedBatch(
        ("a", "b", "c", "d"),
        tables,
        (0, 37, 0, 0),  # row b reads a sliding window from position 37 (its first two blocks dropped)
        (55, 70, 1, 45),  # partly filled last pages; row c reads one token
        uniform(4, 2, 8, 64),
        uniform(blocks * size, 2, 2, 64),
        uniform(blocks * size, 2, 2, 64),
        size,
        (16, 16, 16, 8),  # row d belongs to a group whose blocks hold 8 tokens
    )
    expected = GatherKernel().attend(batch)
    allocator = paged_allocator(MachineConfig(block_size=size, num_blocks=blocks, shape=shape).pool_spec())
    checks = []
    for name in kernels:
        if name == "gather":
            continue
        if clock.share(1) <= 0:
            checks.append(Check("tolerance", "-", name, "incomplete: no time left in its share"))
            continue
        try:
            kernel = make_kernel(name, allocator, shape)
            paged = kernel.attend(batch).float()
        except Exception as error:  # noqa: BLE001 -- a kernel that breaks here is a failed check, in one line
            reason = " ".join(f"{type(error).__name__}: {error}".split())
            checks.append(Check("tolerance", "-", name, f"FAILED: {reason}"))
            continue
        difference = float((paged - expected).abs().max())
        tolerance = kernel.tolerance(shape.dtype)
        mismatch = compare(paged, expected, tolerance)
        verdict = "passed" if mismatch is None else f"FAILED: row {mismatch.row} beyond {tolerance}"
        checks.append(Check("tolerance", "-", name, f"{verdict}: largest difference {difference:.3g} ({tolerance})"))
    return checks


def kernels_section(
    device: str, kernels: list[str], allocators: list[str], clock: Clock, examples: int, env: dict[str, str]
) -> list[Check]:
    """Every kernel on every allocator, kernel by kernel in ``kernels``' order (the slowest last: time the earlier
    runs leave passes to them); on kvfuzz's own allocator, the same run on CPU too where the kernel runs there."""
    on_cpu = {name for name in kernels if device != "cpu" and kernel_unavailable(name, "cpu") is None}
    checks, present = [], []
    for allocator in allocators:
        package = ALLOCATORS.get(allocator)
        if package is not None and importlib.util.find_spec(package) is None:
            checks.append(Check("kernels", allocator, "*", f"unavailable: {package} is not installed"))
        else:
            present.append(allocator)
    planned = [
        (kernel, allocator, allocator == CPU_BESIDE and kernel in on_cpu) for kernel in kernels for allocator in present
    ]
    runs_left = sum(2 if beside else 1 for _, _, beside in planned)
    for kernel, allocator, beside in planned:
        arguments = ["--allocator", allocator, "--kernel", kernel, *SHAPE_ARGUMENTS]
        arguments += ["--examples", str(examples), "--steps", "30"]
        result, rate = kvfuzz_run([*arguments, "--device", device], clock.share(runs_left), env)
        runs_left -= 1
        cpu_rate = None
        if beside:
            cpu_result, cpu_rate = kvfuzz_run([*arguments, "--device", "cpu"], clock.share(runs_left), env)
            runs_left -= 1
            if cpu_result != "passed":
                result = f"{result}; on CPU {cpu_result}"
        checks.append(Check("kernels", allocator, kernel, result, rate, cpu_rate))
    return checks


def table(checks: list[Check], device: str) -> str:
    def rate(value: Optional[float]) -> str:
        return "-" if value is None else f"{value:.3g}"

    header = ["section", "allocator", "kernel", f"{device} steps/s", "cpu steps/s", "result"]
    rows = [header] + [
        [check.section, check.allocator, check.kernel, rate(check.device_rate), rate(check.cpu_rate), check.result]
        for check in checks
    ]
    if device == "cpu":  # a dry run: one device, one column of rates
        rows = [row[:4] + row[5:] for row in rows]
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1] for row in rows)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, a short dry run")
    parser.add_argument("--budget", type=float, help="seconds for all sections (default: 540 on CUDA, 55 on CPU)")
    parser.add_argument("--examples", type=int, help="examples per kvfuzz run (default: 20 on CUDA, 2 on CPU)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated (default: all)")
    parser.add_argument(
        "--allocators", help="comma-separated (default: all on CUDA; on CPU kvfuzz and vLLM v1's, to stay short)"
    )
    args = parser.parse_args(argv)
    if args.device not in ("cuda", "cpu"):
        print(f"gpu_check: --device {args.device!r}: use cuda or cpu", file=sys.stderr)
        return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: --device cuda, but torch sees no CUDA device here (use --device cpu for the dry run)",
            file=sys.stderr,
        )
        return 2
    sys.path.insert(0, str(ROOT))
    cuda = args.device == "cuda"
    budget = args.budget if args.budget is not None else (540.0 if cuda else 55.0)
    examples = args.examples if args.examples is not None else (20 if cuda else 2)
    env = child_env()
    say: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731
    name = torch.cuda.get_device_name() if cuda else "CPU (dry run)"
    say(f"gpu_check on {name}: budget {budget:.0f} s, {examples} examples per run, torch {torch.__version__}")
    started = time.monotonic()
    checks: list[Check] = []
    clock = Clock(budget * SHARES["pools"])
    say("pools: kvfuzz run --device " + args.device)
    checks += pools_section(args.device, clock, examples, env)
    kernels = [kernel for kernel in args.kernels.split(",") if kernel]
    available = []
    for kernel in kernels:
        reason = kernel_unavailable(kernel, args.device)
        if reason is None:
            available.append(kernel)
        else:
            checks.append(Check("kernels", "*", kernel, f"unavailable: {reason}"))
    say("tolerance: " + ", ".join(available))
    clock = Clock(budget * (SHARES["pools"] + SHARES["tolerance"]) - (time.monotonic() - started))
    checks += tolerance_section(args.device, available, clock)
    clock = Clock(budget * (SHARES["pools"] + SHARES["tolerance"] + SHARES["kernels"]) - (time.monotonic() - started))
    say("kernels: " + ", ".join(available))
    default_allocators = list(ALLOCATORS) if cuda else ["kvfuzz", "kvfuzz.adapters.vllm_v1:kv_cache_manager"]
    allocators = default_allocators if args.allocators is None else [a for a in args.allocators.split(",") if a]
    checks += kernels_section(args.device, available, allocators, clock, examples, env)
    say(f"\nsummary ({time.monotonic() - started:.0f} s):")
    say(table(checks, args.device))
    failed = [check for check in checks if check.bad]
    say(f"\n{len(failed)} of {len(checks)} checks failed or did not finish" if failed else "\nevery check passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
