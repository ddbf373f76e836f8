"""Scheduler traces: a failure of a scheduler target, saved so that it can be replayed without Hypothesis.

A scheduler trace is its own kind of file, beside the allocator traces of :mod:`kvfuzz.saved.trace` (format
``kvfuzz-scheduler-trace/1``)::

    {
      "format": "kvfuzz-scheduler-trace/1",
      "kvfuzz_version": "0.1.0",
      "scheduler": "vllm-v1",
      "engine": {"vllm_version": "0.33.0", "model_runner": "V2", "write_path": "vllm", "attention": "gather"},
      "config": {"num_blocks": 8, "block_size": 4, "max_num_batched_tokens": 16, "max_num_seqs": 4,
                 "prefix_caching": true, "speculative_tokens": 2},
      "program": [{"op": "add", "prompt": [1, 2, 3, 0], "max_tokens": 8}, {"op": "step"},
                  {"op": "abort", "request": "r0"}, ...],
      "shrunk": true,
      "failure": {"check": "accounting", "exception": null, "step": 3, "request": null,
                  "message": "accounting check failed at step 3: ..."},
      "known_bug": null
    }

``fixed`` (absent unless set) names the engine's fix of the bug a trace recorded, for a regression trace of a bug the
engine has fixed: a campaign that finds it reproducing reports a regression, never a known finding (a trace cannot
be both that and a ``known_bug``).

``config.speculative_tokens`` (speculative decoding with that many drafts) is written only when it is not 0, and
``config.async_scheduling`` (vLLM's ``AsyncScheduler`` with two batches in flight) only when true; a trace without
them (every trace written before either was driven) has no drafts and is synchronous, so older traces load and keep
their digests. ``engine.model_runner`` is the protocol the worker spoke (``V2``: a preempted request is dropped and
resumed as new; ``V1``: it is kept and resumed among the cached requests); a replay selects the same one.
``engine.write_path`` (who decided where K/V was written) and ``engine.attention`` (the attention check) are written
only when not the defaults (``kvfuzz`` and ``off``), and a replay uses the same. ``program`` is the
client's operations (:mod:`kvfuzz.scheduler.program`); the drain after them is implied. ``shrunk`` is false for the
trace saved when the failure was first found, before shrinking. ``failure.check`` is a check's name
(:class:`~kvfuzz.scheduler.violations.Check`) or ``crash`` for an exception of the engine's own, whose type is
``failure.exception``.

Added without a new format version, each left out at its default so that older traces read and digest as before:
``config.policy`` (``fcfs`` when absent, or ``priority``) and an add's ``priority`` (0 when absent);
``config.cache_salts`` and ``config.stop_tokens`` (false when absent: what the search drew), an add's ``cache_salt``
(none when absent) and ``stop_token_ids`` (none when absent); ``config.eos`` and ``config.min_tokens`` (false when
absent), an add's ``eos`` (false when absent: EOS ignored, as every request before it) and ``min_tokens`` (0 when
absent, at most its ``max_tokens``); ``config.max_loras`` (0 when absent: no LoRA) and an add's ``lora`` (0 when
absent: no adapter; else an adapter's id, 1 .. ``max_loras + 1``); ``config.model`` (``full`` when absent, or another of
:data:`~kvfuzz.scheduler.models.MODELS`: the model served, whose KV-cache groups the engine and the worker keep);
``config.schedule_conservativeness`` (1 when absent; SGLang's, which vLLM refuses other than 1);
``config.prefix_resets`` (false when absent; true: the program may hold ``{"op": "reset_prefix_cache"}``, with
``"preempt": true`` when it preempts the running requests), ``config.kv_events`` (false when absent: KV cache events
off), ``config.kv_events_full`` (false when absent: every request asks for incremental reports),
``config.overlong_requests`` (false when absent; true: an add's ``max_tokens`` may run past
``max_model_len``, up to :func:`~kvfuzz.scheduler.model_length.overlong_limit`); ``config.stats`` (false when absent:
vLLM's scheduler stats off; true: on, and checked); ``config.prefix_match_unit`` (0 when absent: hashes every block;
else the prefix-cache hash granularity, partial prefix caching) and ``config.sessions`` (false when absent; true: an
add may be ``"resumable": true``, and the program may hold ``{"op": "resume", "request": "r0", "prompt": [...],
"max_tokens": n}``) (docs/scheduler-features.md); ``config.drafter`` (``ngram`` when absent, or ``draft-model`` /
``parallel``: how vLLM is told the drafts are made, its draft slots and lookahead;
docs/scheduler-async.md#drafting-slots); ``config.long_prefill_token_threshold`` (0 when absent: no cap),
``config.long_prefill_token_threshold_adaptive`` (false when absent), ``config.max_num_active_seqs`` (0 when absent:
unset) and ``config.prefill_schedule_interval`` (1 when absent: every step), vLLM's scheduler settings of the same
names (docs/oracles.md#the-checks); ``config.pauses`` (false when absent; true: the program may hold
``{"op": "pause"}``, with ``"keep": true`` when nothing is scheduled, and ``{"op": "unpause"}``;
docs/scheduler-features.md); ``config.load_failure_policy`` (``recompute`` when absent, or ``fail``: vLLM's
``kv_load_failure_policy``, docs/scheduler-connectors.md); ``config.skip_prefix_reads`` (false when absent; true: a
quarter of the requests, drawn from their ids, skip reading the prefix cache, docs/scheduler-features.md);
``config.retention`` (``semantic`` when absent, or ``dense`` / ``periodic``: vLLM's prefix-cache retention interval,
docs/scheduler-features.md); ``config.chunked_prefill`` (true when absent; false: vLLM's chunked prefill off, the
target's ``max_model_len`` capped at the token budget, docs/oracles.md); ``config.mamba_checkpoints`` (false when
absent; true: the Mamba hybrid's Mamba layers export prefill checkpoints, as vLLM's Mamba2 mixer does,
docs/scheduler-features.md).
A trace of the ``sglang`` scheduler (SGLang's scheduling pieces, :mod:`kvfuzz.scheduler.sglang`) has the same
fields, its ``engine`` being ``{"sglang_version": "0.5.23"}`` alone (SGLang has no model runner protocol, and its
write path and attention check are SGLang's own); a vLLM trace is read exactly as before.

A trace may come from anywhere, so :func:`load` trusts nothing in it: UTF-8 JSON of at most 16 MiB, no unknown or
missing fields, values of the right JSON types and within :data:`LIMITS`, each problem one
:class:`SchedulerTraceError` line naming the file and the field. :func:`save` writes atomically."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import attrs

import kvfuzz
from kvfuzz import trace_files
from kvfuzz.option_defaults import ATTENTION_NAMES, WRITE_PATH_NAMES
from kvfuzz.scheduler.config import (
    DRAFTERS,
    KV_CONNECTORS,
    LOAD_FAILURE_POLICIES,
    MAX_LORAS,
    MAX_PREFILL_SCHEDULE_INTERVAL,
    MAX_SCHEDULE_CONSERVATIVENESS,
    POLICIES,
    RETENTIONS,
    SchedulerSetup,
)
from kvfuzz.scheduler.crash import crash_message
from kvfuzz.scheduler.fake_model import VOCABULARY
from kvfuzz.scheduler.lora import lora_adapters
from kvfuzz.scheduler.model_length import overlong_limit
from kvfuzz.scheduler.models import MODELS
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, Pause, ResetPrefixCache, Resume, Step, Unpause
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.trace_files import SCHEDULER_FORMAT, Invalid, TraceFileError
from kvfuzz.trace_format import Envelope, TraceFormat, digest

FORMAT = SCHEDULER_FORMAT
SCHEDULERS = ("vllm-v1", "sglang")
"""The scheduler targets a trace may name (``kvfuzz run --scheduler``)."""
SGLANG = "sglang"
"""The scheduler whose traces name SGLang's version (``engine.sglang_version``) and no model runner."""
MODEL_RUNNERS = ("V1", "V2")
CRASH = "crash"
"""``failure.check`` of an exception the engine raised itself."""
LIMITS = {
    "num_blocks": 1 << 16,
    "block_size": 1 << 10,
    "max_num_batched_tokens": 1 << 20,
    "max_num_seqs": 1 << 12,
    "program": 1 << 16,
}
"""The largest configuration values and program a trace may hold."""
MAX_SPECULATIVE_TOKENS = 1 << 6
"""The most drafts per step a trace's configuration may ask for."""
MAX_TRANSFER_DELAY = 1 << 6
"""The most steps late a trace's configuration may let a KV connector's transfer complete."""
MAX_TEXT = 1 << 16
MAX_PRIORITY = 1 << 20
"""The largest priority (in absolute value) an add may carry."""


class SchedulerTraceError(TraceFileError):
    """A file that is not a valid scheduler trace; the message is one line naming the file and the field."""


@attrs.frozen
class RecordedFailure:
    """What broke: a check (``check`` its name) or a crash (``check`` is ``crash``, ``exception`` the type's name),
    at ``step`` about ``request`` where the check names them, and the whole message."""

    check: str
    message: str
    exception: Optional[str] = None
    step: Optional[int] = None
    request: Optional[str] = None

    @classmethod
    def of(cls, error: BaseException) -> RecordedFailure:
        if isinstance(error, SchedulerViolation):
            return cls(error.check.value, str(error), None, error.step, error.request)
        return cls(CRASH, crash_message(error), type(error).__name__)

    def same_kind(self, other: RecordedFailure) -> bool:
        """The same check (for a crash: the same exception type): what a replay must reproduce."""
        return (self.check, self.exception) == (other.check, other.exception)

    def describe(self) -> str:
        return self.message if self.check != CRASH else f"crash: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "exception": self.exception,
            "step": self.step,
            "request": self.request,
            "message": self.message,
        }


def _operations(operations: Any) -> tuple[Operation, ...]:
    return tuple(operations)


@attrs.frozen
class SchedulerTrace:
    """One saved failure of a scheduler target: the scheduler, the engine's configuration and version, the model
    runner protocol, the client's program and the failure. ``shrunk`` is False for the trace saved when the failure
    was first found."""

    scheduler: str
    setup: SchedulerSetup
    model_runner: str  # "V1" or "V2": the protocol the worker spoke ("" for SGLang, which has none)
    vllm_version: str  # the engine's version: vLLM's, or SGLang's for an ``sglang`` trace
    program: tuple[Operation, ...] = attrs.field(converter=_operations)
    failure: RecordedFailure
    shrunk: bool
    known_bug: Optional[str] = None
    kvfuzz_version: str = kvfuzz.__version__
    # the engine's fix of the bug the trace recorded (a regression trace: the failure coming back is a regression)
    fixed: Optional[str] = None
    write_path: str = WRITE_PATH_NAMES[0]  # who decided where K/V was written
    attention: str = ATTENTION_NAMES[0]  # the attention check

    @property
    def engine_name(self) -> str:
        """The engine the trace ran, as a person names it."""
        return "SGLang" if self.scheduler == SGLANG else "vLLM"

    def engine_description(self) -> str:
        """The engine's version, and for vLLM the runner protocol spoken."""
        if self.scheduler == SGLANG:
            return f"SGLang {self.vllm_version}"
        return f"vLLM {self.vllm_version}, {self.model_runner} model runner protocol"

    def engine_json(self) -> dict[str, Any]:
        """The engine's version, the runner protocol, and the write path and attention check unless defaults."""
        if self.scheduler == SGLANG:
            return {"sglang_version": self.vllm_version}
        engine = {"vllm_version": self.vllm_version, "model_runner": self.model_runner}
        if self.write_path != WRITE_PATH_NAMES[0]:
            engine["write_path"] = self.write_path
        if self.attention != ATTENTION_NAMES[0]:
            engine["attention"] = self.attention
        return engine

    def config_json(self) -> dict[str, Any]:
        return setup_json(self.setup)

    def digest(self) -> str:
        """Identifies the failure: the same scheduler, configuration, runner and program give the same digest."""
        key = [self.scheduler, self.config_json(), self.model_runner, [op.to_json() for op in self.program]]
        worker = {name: value for name, value in self.engine_json().items() if name in ("write_path", "attention")}
        if worker:
            key.append(worker)
        return digest(key)

    def file_name(self) -> str:
        return f"{self.scheduler}-{self.failure.check}-{self.digest()}.json"

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "kvfuzz_version": self.kvfuzz_version,
            "scheduler": self.scheduler,
            "engine": self.engine_json(),
            "config": self.config_json(),
            "program": [operation.to_json() for operation in self.program],
            "shrunk": self.shrunk,
            "failure": self.failure.to_json(),
            "known_bug": self.known_bug,
            **({"fixed": self.fixed} if self.fixed else {}),
        }

    def describe(self) -> list[str]:
        """For a person: what was run and what broke (``kvfuzz show``)."""
        lines = [
            f"scheduler trace ({FORMAT}) of {self.scheduler}, {self.engine_description()}"
            + (
                f", write path {self.write_path}, attention {self.attention}"
                if (self.write_path, self.attention) != (WRITE_PATH_NAMES[0], ATTENTION_NAMES[0])
                else ""
            ),
            f"  {self.setup.describe()}",
            f"  {'shrunk' if self.shrunk else 'as first found (not shrunk)'}: {len(self.program)} operation(s), "
            "then the drain",
        ]
        lines += [f"  {index + 1:3}  {operation}" for index, operation in enumerate(self.program)]
        lines += ["", f"failure: {self.failure.describe()}"]
        if self.known_bug:
            lines.append(f"known bug: {self.known_bug}")
        if self.fixed:
            lines.append(f"fixed: {self.fixed}")
        return lines


def setup_json(setup: SchedulerSetup) -> dict[str, Any]:
    """A trace's ``config``: the setup, each field added since the first traces left out at its default."""
    return {  # policy and async_scheduling absent at their defaults: older traces read and hash as before
        "num_blocks": setup.num_blocks,
        "block_size": setup.block_size,
        "max_num_batched_tokens": setup.max_num_batched_tokens,
        "max_num_seqs": setup.max_num_seqs,
        "prefix_caching": setup.prefix_caching,
        **({"policy": setup.policy} if setup.policy != "fcfs" else {}),
        **({"model": setup.model} if setup.model != "full" else {}),
        **({"speculative_tokens": setup.speculative_tokens} if setup.speculative_tokens else {}),
        **({"async_scheduling": True} if setup.async_scheduling else {}),
        **({"cache_salts": True} if setup.cache_salts else {}),
        **({"stop_tokens": True} if setup.stop_tokens else {}),
        **({"eos": True} if setup.eos else {}),
        **({"min_tokens": True} if setup.min_tokens else {}),
        **({"kv_connector": setup.kv_connector} if setup.kv_connector != "none" else {}),
        **({"transfer_delay": setup.transfer_delay} if setup.transfer_delay else {}),
        **({"load_failures": True} if setup.load_failures else {}),
        **({"load_failure_policy": setup.load_failure_policy} if setup.load_failure_policy != "recompute" else {}),
        **({"skip_prefix_reads": True} if setup.skip_prefix_reads else {}),
        **({"retention": setup.retention} if setup.retention != "semantic" else {}),
        **({"max_loras": setup.max_loras} if setup.max_loras else {}),
        **({"prefix_resets": True} if setup.prefix_resets else {}),
        **({"kv_events": True} if setup.kv_events else {}),
        **({"kv_events_full": True} if setup.kv_events_full else {}),
        **({"overlong_requests": True} if setup.overlong_requests else {}),
        **({"stats": True} if setup.stats else {}),
        **({"prefix_match_unit": setup.prefix_match_unit} if setup.prefix_match_unit else {}),
        **({"sessions": True} if setup.sessions else {}),
        **(
            {"schedule_conservativeness": setup.schedule_conservativeness}
            if setup.schedule_conservativeness != 1.0
            else {}
        ),
        **({"drafter": setup.drafter} if setup.drafter != "ngram" else {}),
        **(
            {"long_prefill_token_threshold": setup.long_prefill_token_threshold}
            if setup.long_prefill_token_threshold
            else {}
        ),
        **({"long_prefill_token_threshold_adaptive": True} if setup.long_prefill_token_threshold_adaptive else {}),
        **({"max_num_active_seqs": setup.max_num_active_seqs} if setup.max_num_active_seqs else {}),
        **(
            {"prefill_schedule_interval": setup.prefill_schedule_interval}
            if setup.prefill_schedule_interval > 1
            else {}
        ),
        **({"pauses": True} if setup.pauses else {}),
        **({"chunked_prefill": False} if not setup.chunked_prefill else {}),
        **({"mamba_checkpoints": True} if setup.mamba_checkpoints else {}),
    }


PROCESS_DIED = "SchedulerProcessDied"
"""``failure.exception`` of a trace whose process died running its program (kept from a journal): not shrunk, never
replayed in the process that judges it, since the replay would kill that one too."""


def journal_configuration(setup: SchedulerSetup, model_runner: str) -> dict[str, Any]:
    """What a scheduler target's journal header records of the program about to run
    (:class:`kvfuzz.program.safeguards.Journal`, whose ``target`` payload is ``{"scheduler": ..., "version": ...}``):
    its configuration as a trace records it, and the model runner protocol ("" for SGLang)."""
    return {"config": setup_json(setup), "model_runner": model_runner}


def from_journal(header: dict[str, Any], calls: list[Any], message: str) -> SchedulerTrace:
    """The trace of the program a journal held (``header``, the last header before it; ``calls``, its operations as
    written), whose process died as ``message`` tells: a crash (:data:`PROCESS_DIED`), not shrunk. The journal may
    come from anywhere: it is checked as a trace file is (:class:`SchedulerTraceError`, one line)."""
    runner = header.get("model_runner")
    version = header.get("version")
    engine = {"sglang_version": version} if header.get("scheduler") == SGLANG else {"vllm_version": version}
    data = {
        "format": FORMAT,
        "kvfuzz_version": kvfuzz.__version__,
        "scheduler": header.get("scheduler"),
        "engine": engine if header.get("scheduler") == SGLANG else {**engine, "model_runner": runner},
        "config": header.get("config"),
        "program": calls,
        "shrunk": False,
        "failure": RecordedFailure(CRASH, f"{PROCESS_DIED}: {message}", PROCESS_DIED).to_json(),
        "known_bug": None,
    }
    return from_json(data, "the journal")


def save(trace: SchedulerTrace, directory: Path) -> tuple[Path, bool]:
    """Write ``trace`` into ``directory`` unless a valid trace with its digest is there; returns (path, written).
    Written atomically (:func:`kvfuzz.trace_files.save_trace`); raises ``OSError`` when the directory cannot be
    created or written, leaving no temporary file."""
    return SCHEDULER_TRACE_FORMAT.save(trace, directory)


def load(path: Path) -> SchedulerTrace:
    """Read and check a scheduler trace file; :class:`SchedulerTraceError` (one line naming the file and the field)
    if it is not a valid one. Its bytes are checked as every trace file's are (:func:`kvfuzz.trace_files.read_json`:
    a regular file of at most 16 MiB of UTF-8 JSON, without NaN, repeated fields or too deep a nesting)."""
    return SCHEDULER_TRACE_FORMAT.load(path)


def from_json(data: Any, source: str = "trace") -> SchedulerTrace:
    return SCHEDULER_TRACE_FORMAT.from_json(data, source)


def _trace(data: dict[str, Any], envelope: Envelope) -> SchedulerTrace:
    scheduler = trace_files.choice("scheduler", data["scheduler"], SCHEDULERS)
    setup = _config(data["config"])
    common: dict[str, Any] = {
        "scheduler": scheduler,
        "setup": setup,
        "program": _program(data["program"], setup),
        "failure": _failure(data["failure"]),
        "shrunk": trace_files.boolean("shrunk", data["shrunk"]),
        "known_bug": envelope.known_bug,
        "kvfuzz_version": envelope.kvfuzz_version,
        "fixed": envelope.fixed,
    }
    if scheduler == SGLANG:
        engine = trace_files.fields(data["engine"], "engine", {"sglang_version": True})
        version = trace_files.string("engine.sglang_version", engine["sglang_version"], MAX_TEXT)
        return SchedulerTrace(model_runner="", vllm_version=str(version), **common)
    engine = trace_files.fields(
        data["engine"], "engine", {"vllm_version": True, "model_runner": True, "write_path": False, "attention": False}
    )
    return SchedulerTrace(
        model_runner=trace_files.choice("engine.model_runner", engine["model_runner"], MODEL_RUNNERS),
        vllm_version=str(trace_files.string("engine.vllm_version", engine["vllm_version"], MAX_TEXT)),
        write_path=trace_files.choice(
            "engine.write_path", engine.get("write_path", WRITE_PATH_NAMES[0]), WRITE_PATH_NAMES
        ),
        attention=trace_files.choice("engine.attention", engine.get("attention", ATTENTION_NAMES[0]), ATTENTION_NAMES),
        **common,
    )


SCHEDULER_TRACE_FORMAT = TraceFormat(
    FORMAT,
    "scheduler trace",
    {"scheduler": True, "engine": True, "config": True, "shrunk": True},
    SchedulerTraceError,
    _trace,
)
"""The scheduler targets' format, on the envelope every format shares (:mod:`kvfuzz.trace_format`)."""


def _config(value: Any) -> SchedulerSetup:
    required = {name: True for name in (*LIMITS.keys() - {"program"}, "prefix_caching")}
    optional = {
        "policy": False,
        "model": False,
        "speculative_tokens": False,
        "async_scheduling": False,
        "cache_salts": False,
        "stop_tokens": False,
        "eos": False,
        "min_tokens": False,
        "kv_connector": False,
        "transfer_delay": False,
        "load_failures": False,
        "load_failure_policy": False,
        "skip_prefix_reads": False,
        "retention": False,
        "max_loras": False,
        "prefix_resets": False,
        "kv_events": False,
        "kv_events_full": False,
        "overlong_requests": False,
        "stats": False,
        "prefix_match_unit": False,
        "sessions": False,
        "schedule_conservativeness": False,
        "drafter": False,
        "long_prefill_token_threshold": False,
        "long_prefill_token_threshold_adaptive": False,
        "max_num_active_seqs": False,
        "prefill_schedule_interval": False,
        "pauses": False,
        "chunked_prefill": False,
        "mamba_checkpoints": False,
    }
    config = trace_files.fields(value, "config", {**required, **optional})
    numbers = {
        name: trace_files.integer(f"config.{name}", config[name], 1, LIMITS[name]) for name in LIMITS if name in config
    }
    policy = trace_files.choice("config.policy", config.get("policy", "fcfs"), POLICIES)
    speculative = trace_files.integer(
        "config.speculative_tokens", config.get("speculative_tokens", 0), 0, MAX_SPECULATIVE_TOKENS
    )
    model = trace_files.choice("config.model", config.get("model", "full"), tuple(MODELS))
    connector = trace_files.choice("config.kv_connector", config.get("kv_connector", "none"), KV_CONNECTORS)
    delay = trace_files.integer("config.transfer_delay", config.get("transfer_delay", 0), 0, MAX_TRANSFER_DELAY)
    max_loras = trace_files.integer("config.max_loras", config.get("max_loras", 0), 0, MAX_LORAS)
    match_unit = trace_files.integer(
        "config.prefix_match_unit", config.get("prefix_match_unit", 0), 0, numbers["block_size"]
    )
    try:
        return SchedulerSetup(
            num_blocks=numbers["num_blocks"],
            block_size=numbers["block_size"],
            max_num_batched_tokens=numbers["max_num_batched_tokens"],
            max_num_seqs=numbers["max_num_seqs"],
            prefix_caching=trace_files.boolean("config.prefix_caching", config["prefix_caching"]),
            policy=policy,
            model=model,
            speculative_tokens=speculative,
            async_scheduling=trace_files.boolean("config.async_scheduling", config.get("async_scheduling", False)),
            cache_salts=trace_files.boolean("config.cache_salts", config.get("cache_salts", False)),
            stop_tokens=trace_files.boolean("config.stop_tokens", config.get("stop_tokens", False)),
            eos=trace_files.boolean("config.eos", config.get("eos", False)),
            min_tokens=trace_files.boolean("config.min_tokens", config.get("min_tokens", False)),
            kv_connector=connector,
            transfer_delay=delay,
            load_failures=trace_files.boolean("config.load_failures", config.get("load_failures", False)),
            load_failure_policy=trace_files.choice(
                "config.load_failure_policy", config.get("load_failure_policy", "recompute"), LOAD_FAILURE_POLICIES
            ),
            skip_prefix_reads=trace_files.boolean("config.skip_prefix_reads", config.get("skip_prefix_reads", False)),
            retention=trace_files.choice("config.retention", config.get("retention", "semantic"), RETENTIONS),
            max_loras=max_loras,
            prefix_resets=trace_files.boolean("config.prefix_resets", config.get("prefix_resets", False)),
            kv_events=trace_files.boolean("config.kv_events", config.get("kv_events", False)),
            kv_events_full=trace_files.boolean("config.kv_events_full", config.get("kv_events_full", False)),
            overlong_requests=trace_files.boolean("config.overlong_requests", config.get("overlong_requests", False)),
            stats=trace_files.boolean("config.stats", config.get("stats", False)),
            prefix_match_unit=match_unit,
            sessions=trace_files.boolean("config.sessions", config.get("sessions", False)),
            schedule_conservativeness=trace_files.number(
                "config.schedule_conservativeness",
                config.get("schedule_conservativeness", 1.0),
                MAX_SCHEDULE_CONSERVATIVENESS,
            ),
            drafter=trace_files.choice("config.drafter", config.get("drafter", "ngram"), DRAFTERS),
            long_prefill_token_threshold=trace_files.integer(
                "config.long_prefill_token_threshold",
                config.get("long_prefill_token_threshold", 0),
                0,
                LIMITS["max_num_batched_tokens"],
            ),
            long_prefill_token_threshold_adaptive=trace_files.boolean(
                "config.long_prefill_token_threshold_adaptive",
                config.get("long_prefill_token_threshold_adaptive", False),
            ),
            max_num_active_seqs=trace_files.integer(
                "config.max_num_active_seqs", config.get("max_num_active_seqs", 0), 0, numbers["max_num_seqs"]
            ),
            prefill_schedule_interval=trace_files.integer(
                "config.prefill_schedule_interval",
                config.get("prefill_schedule_interval", 1),
                1,
                MAX_PREFILL_SCHEDULE_INTERVAL,
            ),
            pauses=trace_files.boolean("config.pauses", config.get("pauses", False)),
            chunked_prefill=trace_files.boolean("config.chunked_prefill", config.get("chunked_prefill", True)),
            mamba_checkpoints=trace_files.boolean("config.mamba_checkpoints", config.get("mamba_checkpoints", False)),
        )
    except ValueError as error:
        raise Invalid("config", str(error)) from None


def program_from_json(value: Any, setup: SchedulerSetup) -> tuple[Operation, ...]:
    """A program's JSON operations, checked as a trace's are for ``setup``; :class:`SchedulerTraceError` (one line)
    when they are not a valid program of it."""
    try:
        return tuple(_program(value, setup))
    except Invalid as invalid:
        raise SchedulerTraceError(str(invalid)) from None


def _program(value: Any, setup: SchedulerSetup) -> list[Operation]:
    if not isinstance(value, list):
        raise Invalid("program", f"must be a JSON list, not {type(value).__name__}")
    if len(value) > LIMITS["program"]:
        raise Invalid("program", f"longer than {LIMITS['program']} operations")
    program: list[Operation] = []
    added = 0
    for index, item in enumerate(value):
        where = f"program[{index}]"
        ops = ("add", "abort", "step") + (("reset_prefix_cache",) if setup.prefix_resets else ())
        ops += ("resume",) if setup.sessions else ()
        ops += ("pause", "unpause") if setup.pauses else ()
        if not isinstance(item, dict) or item.get("op") not in ops:
            raise Invalid(where, f"must be an object whose op is {', '.join(ops[:-1])} or {ops[-1]}")
        if item["op"] == "step":
            trace_files.fields(item, where, {"op": True})
            program.append(Step())
        elif item["op"] == "abort":
            request = trace_files.string(
                f"{where}.request", trace_files.fields(item, where, {"op": True, "request": True})["request"], MAX_TEXT
            )
            if not re.fullmatch(r"r\d{1,6}", str(request)) or int(str(request)[1:]) >= added:
                raise Invalid(f"{where}.request", f"must name a request added before it (r0 .. r{added - 1})")
            program.append(Abort(str(request)))
        elif item["op"] == "reset_prefix_cache":
            preempt = trace_files.fields(item, where, {"op": True, "preempt": False}).get("preempt", False)
            program.append(ResetPrefixCache(trace_files.boolean(f"{where}.preempt", preempt)))
        elif item["op"] == "pause":
            keep = trace_files.fields(item, where, {"op": True, "keep": False}).get("keep", False)
            program.append(Pause(trace_files.boolean(f"{where}.keep", keep)))
        elif item["op"] == "unpause":
            trace_files.fields(item, where, {"op": True})
            program.append(Unpause())
        elif item["op"] == "resume":
            item = trace_files.fields(item, where, {"op": True, "request": True, "prompt": True, "max_tokens": True})
            request = trace_files.string(f"{where}.request", item["request"], MAX_TEXT)
            if not re.fullmatch(r"r\d{1,6}", str(request)) or int(str(request)[1:]) >= added:
                raise Invalid(f"{where}.request", f"must name a request added before it (r0 .. r{added - 1})")
            prompt = item["prompt"]
            if not isinstance(prompt, list) or not 1 <= len(prompt) < setup.max_model_len:
                raise Invalid(f"{where}.prompt", f"must be a list of 1..{setup.max_model_len - 1} tokens")
            tokens = [trace_files.integer(f"{where}.prompt", token, 0, VOCABULARY - 1) for token in prompt]
            max_tokens = trace_files.integer(
                f"{where}.max_tokens", item["max_tokens"], 1, setup.max_model_len - len(tokens)
            )
            program.append(Resume(str(request), tokens, max_tokens))
        else:
            extras = dict.fromkeys(
                ("priority", "cache_salt", "stop_token_ids", "eos", "min_tokens", "lora", "resumable"), False
            )
            item = trace_files.fields(item, where, {"op": True, "prompt": True, "max_tokens": True, **extras})
            prompt = item["prompt"]
            if not isinstance(prompt, list) or not 1 <= len(prompt) < setup.max_model_len:
                raise Invalid(f"{where}.prompt", f"must be a list of 1..{setup.max_model_len - 1} tokens")
            tokens = [trace_files.integer(f"{where}.prompt", token, 0, VOCABULARY - 1) for token in prompt]
            room = overlong_limit(setup) - len(tokens) if setup.overlong_requests else setup.max_model_len - len(tokens)
            max_tokens = trace_files.integer(f"{where}.max_tokens", item["max_tokens"], 1, room)
            priority = trace_files.integer(f"{where}.priority", item.get("priority", 0), -MAX_PRIORITY, MAX_PRIORITY)
            salt = trace_files.string(f"{where}.cache_salt", item.get("cache_salt"), MAX_TEXT, optional=True)
            eos = trace_files.boolean(f"{where}.eos", item.get("eos", False))
            min_tokens = trace_files.integer(f"{where}.min_tokens", item.get("min_tokens", 0), 0, max_tokens)
            stops = _stop_token_ids(where, item)
            lora = trace_files.integer(f"{where}.lora", item.get("lora", 0), 0, lora_adapters(setup.max_loras))
            resumable = trace_files.boolean(f"{where}.resumable", item.get("resumable", False))
            if resumable and not setup.sessions:
                raise Invalid(f"{where}.resumable", "is true, but the trace's config does not have sessions")
            program.append(AddRequest(tokens, max_tokens, priority, salt, stops, eos, min_tokens, lora, resumable))
            added += 1
    return program


def _stop_token_ids(where: str, item: dict[str, Any]) -> tuple[int, ...]:
    """An add's stop token ids: distinct tokens of the vocabulary (none when absent)."""
    stops = item.get("stop_token_ids", [])
    if not isinstance(stops, list) or len(set(map(repr, stops))) != len(stops):
        raise Invalid(f"{where}.stop_token_ids", "must be a list of distinct tokens")
    return tuple(trace_files.integer(f"{where}.stop_token_ids", token, 0, VOCABULARY - 1) for token in stops)


def _failure(value: Any) -> RecordedFailure:
    fields = {"check": True, "exception": True, "step": True, "request": True, "message": True}
    failure = trace_files.fields(value, "failure", fields)
    check = trace_files.choice("failure.check", failure["check"], (*(check.value for check in Check), CRASH))
    exception = trace_files.string("failure.exception", failure["exception"], MAX_TEXT, optional=True)
    if (check == CRASH) != (exception is not None):
        raise Invalid("failure.exception", "must name the exception's type for a crash, and be null otherwise")
    step = failure["step"]
    return RecordedFailure(
        check=check,
        message=str(trace_files.string("failure.message", failure["message"], MAX_TEXT)),
        exception=exception,
        step=None if step is None else trace_files.integer("failure.step", step, 0, 1 << 40),
        request=trace_files.string("failure.request", failure["request"], MAX_TEXT, optional=True),
    )
