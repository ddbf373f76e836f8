"""Trace files: a failure found once, saved so that anyone can reproduce it forever, without Hypothesis.

A trace is one JSON object (format ``kvfuzz-trace/1``)::

    {
      "format": "kvfuzz-trace/1",
      "kvfuzz_version": "0.1.0",
      "allocator": "zoo:NoCopyOnWrite",            # MODULE:FACTORY, zoo:NAME, or a registered allocator name
      "config": {"block_size": 4, "num_blocks": 16, "num_host_blocks": 4, "inflight_window": 1,
                 "num_layers": 2, "num_kv_heads": 2, "num_query_heads": 4, "head_dim": 8,
                 "dtype": "float32", "device": "cpu"},
      "program": [{"rule": "admit", "arguments": {"namespace": [], "seq": "s0", "suffix": [0], "system": []}},
                  {"rule": "step", "arguments": {}}, ...],
      "failure": {"invariant": 5, "title": "exclusive writes", "operation": "grow('s1', (0,))",
                  "explanation": "invariant 5 (exclusive writes) violated by ..."},
      "known_bug": null                             # or why this failure is expected (a library's unfixed bug)
    }

``program`` lists the machine's rules with concrete arguments; tuples are written as JSON lists and a misuse call
as ``{"misuse": {"op": ..., "args": [...], "why": ...}}``. ``inflight_window`` records the W the allocator declared
(for a reader; replay uses whatever the allocator declares). A trace with ``known_bug`` null is a regression test
that passes once the failure stops reproducing; one with a reason passes while it still reproduces. ``config`` may
also hold ``"kernel"``, the attention kernel invariant 2 ran (``flex``, ``allocator``); without it, ``gather``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
from pathlib import Path
from typing import Any, Iterable, Optional

import attrs
import torch

import kvfuzz
from kvfuzz.engine.config import MachineConfig
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import InvariantViolation
from kvfuzz.program.call import Call
from kvfuzz.reference.content import ModelShape

FORMAT = "kvfuzz-trace/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_TUPLE_ARGUMENTS = {"namespace", "system"}


class TraceError(ValueError):
    """A file that is not a readable kvfuzz trace."""


def _call_tuple(calls: Iterable[Call]) -> tuple[Call, ...]:
    return tuple(calls)


@attrs.frozen
class Trace:
    """One saved failure: which allocator, which machine configuration, the program, and what broke."""

    allocator: str
    config: MachineConfig
    program: tuple[Call, ...] = attrs.field(converter=_call_tuple)
    failure: dict[str, Any]
    inflight_window: Optional[int] = None
    known_bug: Optional[str] = None
    kvfuzz_version: str = kvfuzz.__version__

    def digest(self) -> str:
        """Identifies the failure: the same allocator, configuration and program give the same digest."""
        key = json.dumps([self.allocator, _config_json(self.config, None), _program_json(self.program)], sort_keys=True)
        return hashlib.sha256(key.encode()).hexdigest()[:12]

    def file_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{self.allocator.split(':')[-1]}-{self.failure.get('title', '')}")
        return f"{slug.strip('-').lower()}-{self.digest()}.json"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kvfuzz_version": self.kvfuzz_version,
            "allocator": self.allocator,
            "config": _config_json(self.config, self.inflight_window),
            "program": _program_json(self.program),
            "failure": self.failure,
            "known_bug": self.known_bug,
        }


def failure_record(violation: InvariantViolation) -> dict[str, Any]:
    return {
        "invariant": violation.invariant.number,
        "title": violation.invariant.title,
        "operation": violation.operation,
        "explanation": violation.explain(),
    }


def save(trace: Trace, directory: Path) -> tuple[Path, bool]:
    """Write ``trace`` into ``directory`` unless the same failure is already saved there; returns (path, written).

    A file of the trace's name counts as saved only if it loads as a trace with the same digest: an empty,
    truncated or damaged one is replaced. The trace is written to a temporary file in the same directory, flushed
    and synced, then renamed over the final name, so that name never holds part of a trace. Raises ``OSError``
    when the directory cannot be created or written (the caller then shows the trace instead, see
    :mod:`kvfuzz.corpus`), leaving no temporary file behind.
    """
    path = directory / trace.file_name()
    if _already_saved(path, trace):
        return path, False
    text = json.dumps(trace.to_json(), indent=2) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # not *.json: never collected
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    _sync_directory(directory)
    return path, True


def _already_saved(path: Path, trace: Trace) -> bool:
    if not path.exists():
        return False
    try:
        return load(path).digest() == trace.digest()
    except TraceError:
        return False


def _sync_directory(directory: Path) -> None:
    """Make the rename durable too, where the platform allows it (best effort: the file itself is synced)."""
    with contextlib.suppress(OSError, AttributeError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def load(path: Path) -> Trace:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise TraceError(f"{path}: not a readable JSON file: {error}") from error
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceError(f'{path}: not a kvfuzz trace (expected "format": "{FORMAT}")')
    try:
        config = data["config"]
        shape = ModelShape(
            config["num_layers"],
            config["num_kv_heads"],
            config["num_query_heads"],
            config["head_dim"],
            DTYPES[config["dtype"]],
            config["device"],
        )
        machine_config = MachineConfig(
            config["block_size"], config["num_blocks"], config["num_host_blocks"], shape, config.get("kernel", "gather")
        )
        program = [
            Call(step["rule"], {name: _decode(name, value) for name, value in step["arguments"].items()})
            for step in data["program"]
        ]
        return Trace(
            data["allocator"],
            machine_config,
            program,
            data["failure"],
            config.get("inflight_window"),
            data.get("known_bug"),
            data.get("kvfuzz_version", "unknown"),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise TraceError(f"{path}: malformed trace: {error!r}") from error


def is_trace_file(path: Path) -> bool:
    """A cheap check for collection: a .json file whose first bytes declare the trace format."""
    if path.suffix != ".json":
        return False
    try:
        with open(path, encoding="utf-8") as handle:
            return FORMAT in handle.read(200)
    except OSError:
        return False


def _config_json(config: MachineConfig, inflight_window: Optional[int]) -> dict[str, Any]:
    shape = config.shape
    dtype = next(name for name, value in DTYPES.items() if value == shape.dtype)
    fields = {
        "block_size": config.block_size,
        "num_blocks": config.num_blocks,
        "num_host_blocks": config.num_host_blocks,
        "inflight_window": inflight_window,
        "num_layers": shape.num_layers,
        "num_kv_heads": shape.num_kv_heads,
        "num_query_heads": shape.num_query_heads,
        "head_dim": shape.head_dim,
        "dtype": dtype,
        "device": shape.device,
    }
    # The default kernel is left out, so traces (and their digests) from before kernels existed stay the same.
    return fields if config.kernel == "gather" else {**fields, "kernel": config.kernel}


def _program_json(program: tuple[Call, ...]) -> list[dict[str, Any]]:
    return [
        {"rule": call.rule, "arguments": {name: _encode(value) for name, value in call.arguments}} for call in program
    ]


def _encode(value: Any) -> Any:
    if isinstance(value, MisuseCall):
        return {"misuse": {"op": value.op, "args": _encode(value.args), "why": value.why}}
    if isinstance(value, (tuple, list)):
        return [_encode(item) for item in value]
    return value


def _tuples(value: Any) -> Any:
    return tuple(_tuples(item) for item in value) if isinstance(value, list) else value


def _decode(name: str, value: Any) -> Any:
    if isinstance(value, dict) and "misuse" in value:
        misuse = value["misuse"]
        return MisuseCall(misuse["op"], _tuples(misuse["args"]), misuse["why"])
    return _tuples(value) if name in _TUPLE_ARGUMENTS else value
