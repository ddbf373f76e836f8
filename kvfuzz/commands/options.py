"""The machine and pool arguments that ``kvfuzz run`` and ``kvfuzz zoo`` share, the configuration they give, the
defaults and checks of the flags several commands share (one meaning and one default each), and the checks every
command applies to its arguments before any work starts. Registering a parser imports nothing heavy (its defaults
come from :mod:`kvfuzz.option_defaults`); a command that drives tensors is marked :func:`needs_torch`, and imports
torch and the engine in its handler."""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from kvfuzz import option_defaults as defaults
from kvfuzz.text import plural
from kvfuzz.torch_check import INSTALL_TORCH, torch_unavailable

if TYPE_CHECKING:
    from kvfuzz.engine.config import MachineConfig

WORKERS_PER_CORE = 4
"""More campaign workers than this many per core only slow each other down: ``--workers`` above it is refused."""


def workers_problem(workers: int) -> Optional[str]:
    """Why ``kvfuzz campaign --workers`` refuses ``workers`` here (one line), or None."""
    cores = os.cpu_count() or 1
    if workers <= WORKERS_PER_CORE * cores:
        return None
    return (
        f"--workers {workers}: more than {WORKERS_PER_CORE} per core ({plural(cores, 'core')} here) only slows "
        f"each worker down; use at most {WORKERS_PER_CORE * cores}"
    )


Handler = Callable[[argparse.Namespace], int]
"""A command's handler: the parsed arguments -> the exit status."""


def needs_torch(handler: Handler) -> Handler:
    """``handler``, run only where torch imports: elsewhere one line on standard error saying what to install, and
    exit status 2, before any work."""

    @functools.wraps(handler)
    def checked(args: argparse.Namespace) -> int:
        problem = torch_unavailable()
        if problem is not None:
            print(
                f"kvfuzz: {args.command} needs torch, which cannot be imported here ({problem}); install it: "
                f"{INSTALL_TORCH}",
                file=sys.stderr,
            )
            return 2
        return handler(args)

    return checked


def progress(line: str) -> None:
    """A progress line of a long command: on standard error, so that standard output (a table, ``--json``) holds
    only the result."""
    print(line, file=sys.stderr, flush=True)


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= minimum``; anything else is a usage error naming the argument."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def check_device(name: str) -> str:
    """``name`` if torch can put tensors there; otherwise ``ValueError`` saying why, in one line."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {name!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return name
    if device.type == "meta":
        raise ValueError(f"--device {name!r} holds no data: kvfuzz compares the K/V it reads back")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name!r}: torch sees no CUDA device here (torch.cuda.is_available() is False)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name!r}: torch sees {count} CUDA device{'s' if count != 1 else ''}")
        return name
    try:
        torch.empty(1, device=device)
    except Exception as error:  # noqa: BLE001 -- whatever torch says about the device, in one line
        raise ValueError(f"--device {name!r}: torch cannot allocate there ({' '.join(str(error).split())})") from None
    return name


def positive_seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def at_least_seconds(text: str) -> float:
    """A number of seconds, 0 or more (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 (no watchdog) or more")
    return value


DEFAULT_CORPUS = defaults.CORPUS
"""Where ``kvfuzz run`` and ``kvfuzz campaign`` save new traces by default: a hidden directory, so that a run inside a
checkout of a project (kvfuzz's own included) never adds failing tests to the directories its pytest collects. A
trace becomes a regression test when it is put in a collected corpus (``--corpus corpus``, or a copy)."""

RUN_EXAMPLES = 300
"""The examples of a ``kvfuzz run`` of an allocator unless ``--examples`` says otherwise: enough for its swarmed
programs to reach the zoo's deep slips in every seed measured (docs/zoo.md), in a few seconds."""

SCHEDULER_EXAMPLES = 100
"""The examples of a ``kvfuzz run --scheduler`` unless ``--examples`` says otherwise (a real scheduler runs some
hundred steps a second, not thousands)."""


def run_examples(examples: Optional[int], scheduler: Optional[str]) -> int:
    """``kvfuzz run``'s budget: ``--examples`` as given, else the default for its target (``scheduler``: the
    ``--scheduler`` named, None for an allocator)."""
    if examples is not None:
        return examples
    return RUN_EXAMPLES if scheduler is None else SCHEDULER_EXAMPLES


def check_database(database: Optional[str]) -> None:
    """``--database`` as every command takes it: ``redis://HOST:PORT/N`` (a server that answers), or a directory (that
    may not exist yet); ``ValueError`` (one line) for another URL, a file, or a Redis that cannot be used."""
    from kvfuzz.campaign.cluster import check_redis_url, is_redis

    if database is None:
        return
    if is_redis(database):
        check_redis_url(database)
    elif "://" in database:
        raise ValueError(f"--database {database}: only redis://HOST:PORT/N URLs, or a directory")
    elif Path(database).exists() and not Path(database).is_dir():
        raise ValueError(f"--database {database}: not a directory")


def machine_arguments(parser: argparse.ArgumentParser, examples: Optional[int] = None) -> None:
    """The machine, pool and model options; ``examples`` is the command's default budget, and its help says so (None:
    ``kvfuzz run``'s, :data:`RUN_EXAMPLES` for an allocator and :data:`SCHEDULER_EXAMPLES` with ``--scheduler``,
    which :func:`run_examples` settles once the target is known)."""
    group = parser.add_argument_group("machine")
    default = f"{RUN_EXAMPLES}; {SCHEDULER_EXAMPLES} with --scheduler" if examples is None else str(examples)
    group.add_argument("--examples", type=at_least(1), default=examples, help=f"examples to run (default {default})")
    group.add_argument("--steps", type=at_least(1), default=50, help="most operations per example (default 50)")
    group.add_argument("--seed", type=int, help="random seed (default: derandomized, the same run every time)")
    group.add_argument("--no-shrink", action="store_true", help="report the first failure as found, unshrunk")
    group.add_argument(
        "--call-timeout",
        type=at_least_seconds,
        default=defaults.CALL_TIMEOUT,
        metavar="SECONDS",
        help=f"an operation still running after this long is reported as a hang (default {defaults.CALL_TIMEOUT:g}; "
        "0 switches the watchdog off)",
    )
    pool = parser.add_argument_group("pool and model")
    pool.add_argument("--block-size", type=at_least(1), default=defaults.BLOCK_SIZE)
    pool.add_argument("--num-blocks", type=at_least(1), default=defaults.NUM_BLOCKS)
    pool.add_argument("--host-blocks", type=at_least(0), default=defaults.NUM_HOST_BLOCKS)
    pool.add_argument("--layers", type=at_least(1), default=defaults.NUM_LAYERS)
    pool.add_argument("--kv-heads", type=at_least(1), default=defaults.NUM_KV_HEADS)
    pool.add_argument(
        "--query-heads", type=at_least(1), default=defaults.NUM_QUERY_HEADS, help="a multiple of --kv-heads"
    )
    pool.add_argument("--head-dim", type=at_least(1), default=defaults.HEAD_DIM)
    pool.add_argument("--dtype", choices=sorted(defaults.DTYPE_NAMES), default="float32")
    pool.add_argument("--device", default="cpu", help="torch device of the pools: cpu (default), cuda, cuda:N")


def machine_config(args: argparse.Namespace) -> MachineConfig:
    """The configuration :func:`machine_arguments` parsed; ``ValueError`` (one line) where it is inconsistent."""
    from kvfuzz.engine.config import DTYPES, MachineConfig
    from kvfuzz.reference.content import ModelShape

    if args.query_heads % args.kv_heads:
        raise ValueError(
            f"--query-heads {args.query_heads} is not a multiple of --kv-heads {args.kv_heads} (grouped queries)"
        )
    device = check_device(args.device)
    shape = ModelShape(args.layers, args.kv_heads, args.query_heads, args.head_dim, DTYPES[args.dtype], device)
    return MachineConfig(args.block_size, args.num_blocks, args.host_blocks, shape)
