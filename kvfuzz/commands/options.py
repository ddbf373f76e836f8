"""The machine and pool arguments that ``kvfuzz run`` and ``kvfuzz zoo`` share, the configuration they give, the
defaults and checks of the flags several commands share (one meaning and one default each), and the checks every
command applies to its arguments before any work starts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Optional

import torch

from kvfuzz.campaign.store import check_redis_url, is_redis
from kvfuzz.engine.config import DTYPES, MachineConfig
from kvfuzz.program.safeguards import DEFAULT_CALL_TIMEOUT
from kvfuzz.reference.content import ModelShape


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


def at_least_seconds(text: str) -> float:
    """A number of seconds, 0 or more (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text!r}: must be 0 (no watchdog) or more")
    return value


DEFAULT_CORPUS = ".kvfuzz/corpus"
"""Where ``kvfuzz run`` and ``kvfuzz campaign`` save new traces by default: a hidden directory, so that a run inside a
checkout of a project (kvfuzz's own included) never adds failing tests to the directories its pytest collects. A
trace becomes a regression test when it is put in a collected corpus (``--corpus corpus``, or a copy)."""

RUN_EXAMPLES = 100
"""The examples of a ``kvfuzz run`` unless ``--examples`` says otherwise."""


def check_database(database: Optional[str]) -> None:
    """``--database`` as every command takes it: ``redis://HOST:PORT/N`` (a server that answers), or a directory (that
    may not exist yet); ``ValueError`` (one line) for another URL, a file, or a Redis that cannot be used."""
    if database is None:
        return
    if is_redis(database):
        check_redis_url(database)
    elif "://" in database:
        raise ValueError(f"--database {database}: only redis://HOST:PORT/N URLs, or a directory")
    elif Path(database).exists() and not Path(database).is_dir():
        raise ValueError(f"--database {database}: not a directory")


def machine_arguments(parser: argparse.ArgumentParser, examples: int = RUN_EXAMPLES) -> None:
    """The machine, pool and model options; ``examples`` is the command's default budget, and its help says so."""
    group = parser.add_argument_group("machine")
    group.add_argument("--examples", type=at_least(1), default=examples, help=f"examples to run (default {examples})")
    group.add_argument("--steps", type=at_least(1), default=50, help="most operations per example (default 50)")
    group.add_argument("--seed", type=int, help="random seed (default: derandomized, the same run every time)")
    group.add_argument("--no-shrink", action="store_true", help="report the first failure as found, unshrunk")
    group.add_argument(
        "--call-timeout",
        type=at_least_seconds,
        default=DEFAULT_CALL_TIMEOUT,
        metavar="SECONDS",
        help=f"an operation still running after this long is reported as a hang (default {DEFAULT_CALL_TIMEOUT:g}; "
        "0 switches the watchdog off)",
    )
    pool = parser.add_argument_group("pool and model")
    pool.add_argument("--block-size", type=at_least(1), default=MachineConfig().block_size)
    pool.add_argument("--num-blocks", type=at_least(1), default=MachineConfig().num_blocks)
    pool.add_argument("--host-blocks", type=at_least(0), default=MachineConfig().num_host_blocks)
    pool.add_argument("--layers", type=at_least(1), default=ModelShape().num_layers)
    pool.add_argument("--kv-heads", type=at_least(1), default=ModelShape().num_kv_heads)
    pool.add_argument(
        "--query-heads", type=at_least(1), default=ModelShape().num_query_heads, help="a multiple of --kv-heads"
    )
    pool.add_argument("--head-dim", type=at_least(1), default=ModelShape().head_dim)
    pool.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    pool.add_argument("--device", default="cpu", help="torch device of the pools: cpu (default), cuda, cuda:N")


def machine_config(args: argparse.Namespace) -> MachineConfig:
    """The configuration :func:`machine_arguments` parsed; ``ValueError`` (one line) where it is inconsistent."""
    if args.query_heads % args.kv_heads:
        raise ValueError(
            f"--query-heads {args.query_heads} is not a multiple of --kv-heads {args.kv_heads} (grouped queries)"
        )
    device = check_device(args.device)
    shape = ModelShape(args.layers, args.kv_heads, args.query_heads, args.head_dim, DTYPES[args.dtype], device)
    return MachineConfig(args.block_size, args.num_blocks, args.host_blocks, shape)
