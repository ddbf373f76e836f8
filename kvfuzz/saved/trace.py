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

``fixed`` (absent unless set) names the fix of the bug a trace recorded, for a regression trace of a bug the
allocator has fixed: a campaign that finds it reproducing reports a regression, never a known finding
(:mod:`kvfuzz.campaign.known`); a trace cannot be both that and a ``known_bug``. As a regression test it is a trace
whose ``known_bug`` is null.

``program`` lists the machine's rules with concrete arguments; tuples are written as JSON lists and a misuse call
as ``{"misuse": {"op": ..., "args": [...], "why": ...}}``. ``inflight_window`` records the W the allocator declared
when the failure was found; a replay asks the allocator's factory for that W (``PoolSpec.inflight_window``), so a
trace of a campaign that swarmed W replays with its W. A trace with ``known_bug`` null is a regression test
that passes once the failure stops reproducing; one with a reason passes while it still reproduces. ``config`` may
also hold ``"kernel"``, the attention kernel invariant 2 ran (``flex``, ``allocator``); without it, ``gather``.
A trace written by ``kvfuzz campaign`` also holds ``"swarm"``: the program length and the operations of the
configuration its search drew (``{"program_length": 40, "operations": ["admit", "step", ...]}``); the geometry it
drew is the trace's ``config``, so replay and export run exactly that pool. Traces without it load as before.
A broken invariant's ``failure`` also holds ``"cause"`` where its check named one (``"a cache hit covering the whole
prompt"``): a replay reproduces the failure only if it breaks the same invariant for the same cause. Traces without
it (written before checks named causes) reproduce on the same invariant, as before.

A trace may come from anywhere, so :func:`load` trusts nothing in it: it reads UTF-8 JSON files of at most 16 MiB,
refuses unknown fields, wrong JSON types, rules that are not operations, arguments that are not exactly the
operation's, and a pool geometry over :data:`GEOMETRY_LIMITS` or over 1 GiB of K/V pools, each as one
:class:`TraceError` line naming the file and the field. :func:`save` writes atomically.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable, Optional

import attrs
import torch

import kvfuzz
from kvfuzz import trace_files
from kvfuzz.engine.config import DTYPES, MachineConfig, config_json
from kvfuzz.engine.misuse import MisuseCall
from kvfuzz.engine.violations import Invariant, InvariantViolation
from kvfuzz.kernels import KERNEL_NAMES
from kvfuzz.program.call import Call, program_json
from kvfuzz.program.operations import BY_NAME
from kvfuzz.reference.content import ModelShape
from kvfuzz.trace_files import FORMAT, Invalid, TraceFileError, show
from kvfuzz.trace_format import Envelope, TraceFormat, digest

_TUPLE_ARGUMENTS = {"namespace", "system"}


class TraceError(TraceFileError):
    """A file that is not a valid kvfuzz trace; the message is one line that names the file and the field."""


def _call_tuple(calls: Iterable[Call]) -> tuple[Call, ...]:
    return tuple(calls)


@attrs.frozen
class Trace:
    """One saved failure: which allocator, which machine configuration, the program, and what broke.

    ``config.inflight_window`` is the W asked of the allocator's factory (None: its own); ``declared_window`` the W
    the allocator declared (``Capabilities.inflight_window``; None: not known). The file records the declared W, or
    the asked one when none is known, and a loaded trace asks for the W its file records."""

    allocator: str
    config: MachineConfig
    program: tuple[Call, ...] = attrs.field(converter=_call_tuple)
    failure: dict[str, Any]
    declared_window: Optional[int] = None
    known_bug: Optional[str] = None
    kvfuzz_version: str = kvfuzz.__version__
    flaky: Optional[tuple[int, int]] = None  # (reproduced, replays) when confirmation replays did not all fail
    swarm: Optional[dict[str, Any]] = None  # a campaign's draw: {"program_length": n, "operations": [...]}
    fixed: Optional[str] = None  # the fix of the bug a regression trace recorded (never with known_bug)

    def digest(self) -> str:
        """Identifies the failure: the same allocator, configuration and program give the same digest."""
        return digest([self.allocator, config_json(self.config, None), program_json(self.program)])

    def file_name(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{self.allocator.split(':')[-1]}-{self.failure.get('title', '')}")
        return f"{slug.strip('-').lower()}-{self.digest()}.json"

    def recorded_window(self) -> Optional[int]:
        """The W the file records: the declared one, else the one asked for."""
        return self.config.inflight_window if self.declared_window is None else self.declared_window

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kvfuzz_version": self.kvfuzz_version,
            "allocator": self.allocator,
            "config": config_json(self.config, self.recorded_window()),
            "program": program_json(self.program),
            "failure": self.failure,
            "known_bug": self.known_bug,
            **({} if self.flaky is None else {"flaky": {"reproduced": self.flaky[0], "replays": self.flaky[1]}}),
            **({} if self.swarm is None else {"swarm": self.swarm}),
            **({"fixed": self.fixed} if self.fixed else {}),
        }


def failure_record(violation: InvariantViolation) -> dict[str, Any]:
    record = {
        "invariant": violation.invariant.number,
        "title": violation.invariant.title,
        "operation": violation.operation,
        "explanation": violation.explain(),
    }
    return {**record, "cause": violation.cause.words} if violation.cause.words else record


def save(trace: Trace, directory: Path) -> tuple[Path, bool]:
    """Write ``trace`` into ``directory`` unless the same failure is already saved there (a file of its name that
    loads as a trace with the same digest); returns (path, written). Written atomically
    (:func:`kvfuzz.trace_files.save_trace`); raises ``OSError`` when the directory cannot be created or written (the
    caller then shows the trace instead, see :mod:`kvfuzz.saved.corpus`), leaving no temporary file behind."""
    return TRACE_FORMAT.save(trace, directory)


# -- reading and validating a trace --------------------------------------------------------------------------------
#
# A trace comes from anywhere (a bug report, a pull request), so nothing in it is trusted: ``load`` checks every field
# before replay allocates pools, calls the allocator or writes Python, and reports the first problem as one line that
# names the file and the field.

MAX_PROGRAM_CALLS = 100_000
MAX_POOL_BYTES = 2**30
"""Replay allocates the device and host K/V pools of the trace's configuration: at most 1 GiB."""
GEOMETRY_LIMITS = {
    "block_size": (1, 1024),
    "num_blocks": (1, 65536),
    "num_host_blocks": (0, 65536),
    "num_layers": (1, 256),
    "num_kv_heads": (1, 256),
    "num_query_heads": (1, 1024),
    "head_dim": (1, 1024),
}
"""Each field's range; their product is bounded by :data:`MAX_POOL_BYTES` as well."""
MAX_INFLIGHT_WINDOW = 65536
MAX_TEXT = 100_000  # characters of one string field (an explanation, a misuse call's reason)
MAX_NAME = 1000  # characters of a name: the allocator, a sequence id, a namespace part
MAX_LIST = 100_000  # items of one list argument
_INT64 = (-(2**63), 2**63 - 1)
_DEVICE = re.compile(r"cpu|cuda(:[0-9]{1,3})?")
MISUSE_OPERATIONS = ("admit", "grow", "fork", "free", "preempt", "swap_out", "swap_in", "rollback", "evict")
"""The allocator operations a recorded misuse call may name (the contract's, never an arbitrary attribute)."""
_CONFIG_FIELDS = {name: True for name in GEOMETRY_LIMITS}
_CONFIG_FIELDS.update({"inflight_window": False, "dtype": True, "device": True, "kernel": False})
_FAILURE_FIELDS = {"invariant": True, "title": True, "operation": False, "explanation": False, "cause": False}


class TraceUnavailable(TraceError):
    """A valid trace that needs what this environment lacks (a CUDA device): replay skips it."""


def load(path: Path) -> Trace:
    """Read and validate the trace in ``path``.

    Raises :class:`TraceError`, with one line naming the file and the field, for anything that is not a valid
    ``kvfuzz-trace/1`` trace: a file over 16 MiB, one that is not UTF-8 JSON (or nests too deeply), another or a
    newer format, an unknown or missing field, a value of the wrong JSON type, a pool geometry over the limits
    (:data:`GEOMETRY_LIMITS`, and K/V pools over 1 GiB), a program over 100,000 calls, a rule that is no operation
    of :data:`kvfuzz.program.operations.BY_NAME`, or arguments that are not exactly the operation's.
    :class:`TraceUnavailable` (a ``TraceError``) is a valid trace for a device this machine lacks.
    """
    return TRACE_FORMAT.load(path)


def from_json(data: Any, source: str = "trace") -> Trace:
    """A trace from its JSON object (``json.loads`` of a trace file), validated as :func:`load` validates a file;
    ``source`` names it at the start of each :class:`TraceError` line."""
    return TRACE_FORMAT.from_json(data, source)


def program_from_json(value: Any, source: str = "program") -> list[Call]:
    """The calls of a program as a trace (and a journal) lists them, checked as :func:`load` checks a trace's:
    :class:`TraceError` names ``source`` and the call."""
    try:
        return _program(value)
    except Invalid as error:
        raise TraceError(f"{source}: {error}") from None


def _name(field: str, value: Any) -> str:
    text = trace_files.string(field, value, MAX_NAME)
    assert text is not None
    if not text.isprintable():
        raise Invalid(field, f"{show(text)} holds control characters")
    return text


def _trace(data: dict[str, Any], envelope: Envelope) -> Trace:
    allocator = _name("allocator", data["allocator"])
    if not allocator:
        raise Invalid("allocator", "empty")
    config = _config(data["config"])
    program = _program(data["program"])
    failure = _failure(data["failure"])
    flaky = _flaky(data.get("flaky"))
    swarm = _swarm(data.get("swarm"))
    known_bug, version, fixed = envelope.known_bug, envelope.kvfuzz_version, envelope.fixed
    return Trace(allocator, config, program, failure, config.inflight_window, known_bug, version, flaky, swarm, fixed)


TRACE_FORMAT = TraceFormat(
    FORMAT,
    "kvfuzz trace",
    {"allocator": True, "config": True, "flaky": False, "swarm": False},
    TraceError,
    _trace,
)
"""The allocator target's format, on the envelope every format shares (:mod:`kvfuzz.trace_format`)."""


def _swarm(value: Any) -> Optional[dict[str, Any]]:
    """``{"program_length": n, "operations": [names]}``: the configuration a campaign drew for the search that
    found the failure (the pool geometry is in ``config``); absent from traces of ``kvfuzz run``."""
    if value is None:
        return None
    fields = trace_files.fields(value, "swarm", {"program_length": True, "operations": True})
    length = trace_files.integer("swarm.program_length", fields["program_length"], 1, MAX_PROGRAM_CALLS)
    names = _list("swarm.operations", fields["operations"])
    for index, name in enumerate(names):
        if not isinstance(name, str) or name not in BY_NAME:
            raise Invalid(f"swarm.operations[{index}]", f"{show(name)} is not an operation")
    return {"program_length": length, "operations": list(names)}


def _flaky(value: Any) -> Optional[tuple[int, int]]:
    """``{"reproduced": k, "replays": n}``: the recorded failure reproduced in k of n confirmation replays."""
    if value is None:
        return None
    fields = trace_files.fields(value, "flaky", {"reproduced": True, "replays": True})
    replays = trace_files.integer("flaky.replays", fields["replays"], 1, 1000)
    return trace_files.integer("flaky.reproduced", fields["reproduced"], 0, replays), replays


def _config(value: Any) -> MachineConfig:
    """The configuration a trace records, asking the allocator's factory for the W it recorded."""
    config = trace_files.fields(value, "config", _CONFIG_FIELDS)
    limit = " (kvfuzz's limits keep one example's K/V pools under 1 GiB)"
    sizes = {
        name: trace_files.integer(f"config.{name}", config[name], *GEOMETRY_LIMITS[name], limit)
        for name in GEOMETRY_LIMITS
    }
    window = config.get("inflight_window")
    if window is not None:
        trace_files.integer("config.inflight_window", window, 0, MAX_INFLIGHT_WINDOW)
    dtype = config["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise Invalid("config.dtype", f"{show(dtype)} is not one of {', '.join(DTYPES)}")
    device = config["device"]
    if not isinstance(device, str) or not _DEVICE.fullmatch(device):
        raise Invalid("config.device", f"{show(device)} is not a device kvfuzz runs on (cpu, cuda, cuda:N)")
    kernel = config.get("kernel", "gather")
    if not isinstance(kernel, str) or kernel not in KERNEL_NAMES:
        raise Invalid("config.kernel", f"{show(kernel)} is not one of {', '.join(KERNEL_NAMES)}")
    if sizes["num_query_heads"] % sizes["num_kv_heads"]:
        raise Invalid(
            "config.num_query_heads",
            f"{sizes['num_query_heads']} is not a multiple of config.num_kv_heads ({sizes['num_kv_heads']})",
        )
    element = torch.empty((), dtype=DTYPES[dtype]).element_size()
    row = sizes["block_size"] * sizes["num_layers"] * sizes["num_kv_heads"] * sizes["head_dim"] * element
    pools = 2 * (sizes["num_blocks"] + sizes["num_host_blocks"]) * row
    if pools > MAX_POOL_BYTES:
        raise Invalid(
            "config",
            f"the K/V pools would take {pools / 2**30:.1f} GiB (K and V x (num_blocks + num_host_blocks) x "
            f"block_size x num_layers x num_kv_heads x head_dim x {element} bytes); a trace may ask for at most 1 GiB",
        )
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            raise TraceUnavailable(f"config.device: the trace ran on {device}, and torch sees no such CUDA device here")
    shape = ModelShape(
        sizes["num_layers"], sizes["num_kv_heads"], sizes["num_query_heads"], sizes["head_dim"], DTYPES[dtype], device
    )
    return MachineConfig(sizes["block_size"], sizes["num_blocks"], sizes["num_host_blocks"], shape, kernel, window)


def _program(value: Any) -> list[Call]:
    if not isinstance(value, list):
        raise Invalid("program", f"must be a JSON list of calls, not {show(value)}")
    if len(value) > MAX_PROGRAM_CALLS:
        raise Invalid("program", f"{len(value)} calls; a trace holds at most {MAX_PROGRAM_CALLS}")
    return [_call(f"program[{index}]", step) for index, step in enumerate(value)]


def _call(where: str, value: Any) -> Call:
    step = trace_files.fields(value, where, {"rule": True, "arguments": True})
    rule = step["rule"]
    operation = BY_NAME.get(rule) if isinstance(rule, str) else None
    if operation is None:
        raise Invalid(f"{where}.rule", f"{show(rule)} is not an operation (operations: {', '.join(BY_NAME)})")
    arguments = step["arguments"]
    if not isinstance(arguments, dict):
        raise Invalid(f"{where}.arguments", f"must be a JSON object, not {show(arguments)}")
    kinds = dict(operation.arguments)
    if set(arguments) != set(kinds):
        unexpected = [f"unexpected {name}" for name in arguments if name not in kinds]
        missing = [f"missing {name}" for name in kinds if name not in arguments]
        takes = f"({', '.join(kinds)})" if kinds else "no arguments"
        raise Invalid(f"{where}.arguments", f"{rule} takes {takes}: {', '.join(missing + unexpected)}")
    return Call(
        rule, {name: _argument(f"{where}.arguments.{name}", name, kinds[name], arguments[name]) for name in kinds}
    )


def _argument(field: str, name: str, kind: Any, value: Any) -> Any:
    """A recorded argument, checked against its JSON type and decoded (tuples where the machine draws tuples). Replay
    then checks it is one the operation could have drawn, in the state the calls before it leave."""
    expected = ARGUMENT_TYPES.get(name) or _KIND_TYPES.get(type(kind).__name__, "value")
    if expected == "string":
        return _name(field, value)
    if expected == "integer":
        return trace_files.integer(field, value, *_INT64)
    if expected == "strings":
        return tuple(_name(f"{field}[{index}]", item) for index, item in enumerate(_list(field, value)))
    if expected == "integers":
        items = [
            trace_files.integer(f"{field}[{index}]", item, *_INT64) for index, item in enumerate(_list(field, value))
        ]
        return tuple(items) if name in _TUPLE_ARGUMENTS else items
    if expected == "misuse":
        return _misuse(field, value)
    return _plain(field, value, depth=2)  # an argument kind this trace format does not know: plain values only


ARGUMENT_TYPES = {
    "seq": "string",
    "parent": "string",
    "child": "string",
    "namespace": "strings",
    "system": "integers",
    "suffix": "integers",
    "tokens": "integers",
    "token": "integer",
    "num_tokens": "integer",
    "num_blocks": "integer",
    "call": "misuse",
}
"""The JSON type of each argument the operations take, by name (an operation's argument kind decides otherwise)."""
_KIND_TYPES = {"NewSeqId": "string", "Integers": "integer", "TokenLists": "integers", "BlockIds": "integers"}


def _list(field: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise Invalid(field, f"must be a JSON list, not {show(value)}")
    if len(value) > MAX_LIST:
        raise Invalid(field, f"{len(value)} items; at most {MAX_LIST}")
    return value


def _plain(field: str, value: Any, depth: int) -> Any:
    """A string, an integer, or (``depth`` levels deep) a list of them, with lists as tuples."""
    if isinstance(value, str):
        return _name(field, value)
    if type(value) is int:
        return trace_files.integer(field, value, *_INT64)
    if isinstance(value, list) and depth > 0:
        return tuple(_plain(f"{field}[{index}]", item, depth - 1) for index, item in enumerate(_list(field, value)))
    raise Invalid(field, f"{show(value)} is not a string, an integer{' or a list of them' if depth else ''}")


def _misuse(field: str, value: Any) -> MisuseCall:
    call = trace_files.fields(
        trace_files.fields(value, field, {"misuse": True})["misuse"],
        f"{field}.misuse",
        {"op": True, "args": True, "why": True},
    )
    op = call["op"]
    if op not in MISUSE_OPERATIONS:
        raise Invalid(
            f"{field}.misuse.op", f"{show(op)} is not an allocator operation ({', '.join(MISUSE_OPERATIONS)})"
        )
    args = _plain(f"{field}.misuse.args", _list(f"{field}.misuse.args", call["args"]), depth=2)
    return MisuseCall(op, args, trace_files.string(f"{field}.misuse.why", call["why"], MAX_TEXT) or "")


def _failure(value: Any) -> dict[str, Any]:
    failure = trace_files.fields(value, "failure", _FAILURE_FIELDS)
    invariant = failure["invariant"]
    if invariant is not None and invariant not in {number.number for number in Invariant}:
        raise Invalid("failure.invariant", f"{show(invariant)} is not an invariant's number, nor null (a crash)")
    trace_files.string("failure.title", failure["title"], MAX_NAME)
    trace_files.string("failure.operation", failure.get("operation"), MAX_TEXT, optional=True)
    trace_files.string("failure.explanation", failure.get("explanation", ""), MAX_TEXT)
    trace_files.string("failure.cause", failure.get("cause"), MAX_TEXT, optional=True)
    return failure
