"""``kvfuzz run --scheduler NAME``: the Hypothesis machine against a real scheduler, every check on, and its outcome
printed (or one JSON object). Usage errors are one line on standard error and exit status 2, before any work:
flags that mean nothing to a scheduler target, and vLLM not installed here."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import attrs

from kvfuzz import option_defaults as defaults
from kvfuzz.option_defaults import ATTENTION_NAMES, WRITE_PATH_NAMES
from kvfuzz.text import plural

if TYPE_CHECKING:
    from hypothesis.database import ExampleDatabase

    from kvfuzz.program.safeguards import Journal
    from kvfuzz.scheduler.config import SchedulerSetup
    from kvfuzz.scheduler.session import WorkerFactory

SCHEDULERS = {
    "vllm-v1": "vLLM's v1 Scheduler with its KVCacheManager",
    "sglang": "SGLang's SchedulePolicy, PrefillAdder and ScheduleBatch over its radix cache",
}
"""The schedulers ``--scheduler`` names, and what each is."""

_ALLOCATOR_ONLY = (
    ("kernel", "gather", "--kernel"),
    ("host_blocks", defaults.NUM_HOST_BLOCKS, "--host-blocks"),
    ("layers", defaults.NUM_LAYERS, "--layers"),
    ("kv_heads", defaults.NUM_KV_HEADS, "--kv-heads"),
    ("query_heads", defaults.NUM_QUERY_HEADS, "--query-heads"),
    ("head_dim", defaults.HEAD_DIM, "--head-dim"),
    ("dtype", "float32", "--dtype"),
    ("device", "cpu", "--device"),
)
"""(attribute, its default, flag) of ``kvfuzz run``'s options that a scheduler target does not take (yet)."""

SCHEDULER_ONLY = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "no_prefix_caching",
    "policy",
    "speculative_tokens",
    "write_path",
    "attention",
    "async_scheduling",
    "model",
    "cache_salts",
    "stop_tokens",
    "eos",
    "min_tokens",
    "kv_connector",
    "transfer_delay",
    "load_failures",
    "load_failure_policy",
    "skip_prefix_reads",
    "retention",
    "max_loras",
    "prefix_resets",
    "kv_events",
    "kv_events_full",
    "overlong_requests",
    "stats",
    "prefix_match_unit",
    "sessions",
    "drafter",
    "long_prefill_token_threshold",
    "long_prefill_token_threshold_adaptive",
    "max_num_active_seqs",
    "prefill_schedule_interval",
    "pauses",
    "no_chunked_prefill",
    "mamba_checkpoints",
    "untested_engine",
)
"""The attributes of the options only a scheduler target takes."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of a scheduler target (``kvfuzz run``'s ``--scheduler`` is registered beside ``--allocator``)."""
    group = parser.add_argument_group("scheduler target (with --scheduler; docs/scheduler.md)")
    group.add_argument(
        "--untested-engine",
        action="store_true",
        default=None,
        help="run on an engine version kvfuzz is not tested on (refused otherwise; docs/scheduler.md, Versions)",
    )
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        metavar="N",
        help="the step's token budget; longer prompts are prefilled in chunks "
        f"(default {defaults.SCHEDULER_TOKEN_BUDGET})",
    )
    group.add_argument(
        "--max-num-seqs", type=int, metavar="N", help=f"most running requests (default {defaults.SCHEDULER_MAX_SEQS})"
    )
    group.add_argument("--no-prefix-caching", action="store_true", default=None, help="switch prefix caching off")
    group.add_argument(
        "--policy",
        choices=defaults.SCHEDULER_POLICIES,
        help="vLLM's scheduling policy; under priority every request is drawn with a priority (default fcfs)",
    )
    group.add_argument(
        "--model",
        choices=defaults.SCHEDULER_MODELS,
        help="the model served, which decides the KV-cache groups: full (attention), or sliding-window (sliding "
        "window and full attention layers, two groups in one pool), or mamba-hybrid (a Mamba layer beside a "
        "full-attention layer, a Mamba group and an attention group), or chunked-local (a chunked local attention "
        "layer beside a full-attention one, two groups in one pool), or sliding-window-groups (two sliding-window "
        "layers and a full-attention one, three groups in one pool, two of one kind), or rswa (R-SWA layers: the "
        "prompt kept and a window of generated tokens, one group) (default full)",
    )
    group.add_argument(
        "--speculative-tokens",
        type=int,
        metavar="K",
        help="speculative decoding with up to K drafts per request and step, accepted and rejected by the fake model "
        "(default 0: none)",
    )
    group.add_argument(
        "--write-path",
        choices=WRITE_PATH_NAMES,
        help="who decides where K/V is written: kvfuzz's own slot mapping (the default: fast), or vLLM's "
        "worker-side block tables and slot mapping kernel, checked against kvfuzz's tables (Triton's interpreter; "
        "about 9x the CPU)",
    )
    group.add_argument(
        "--attention",
        choices=ATTENTION_NAMES,
        help="attention of every scheduled token through the tables, against the reference (default off)",
    )
    group.add_argument(
        "--async-scheduling",
        action="store_true",
        default=None,
        help="vLLM's AsyncScheduler, two batches in flight as its engine core runs them",
    )
    group.add_argument(
        "--kv-connector",
        choices=("none", "offloading", "pd"),
        help="vLLM's OffloadingConnector, kvfuzz as its worker side, or pd: kvfuzz's P/D-disaggregation connector "
        "(remote loads, sends that delay frees; deferred frees under async scheduling) (default none; "
        "docs/scheduler-connectors.md)",
    )
    group.add_argument(
        "--transfer-delay",
        type=int,
        help="with --kv-connector: the most steps a store, load or send completes late (default 0)",
    )
    group.add_argument(
        "--load-failures",
        action="store_true",
        default=None,
        help="with --kv-connector: loads may fail (part-way; with pd, whole too), recovered by vLLM's recompute policy",
    )
    group.add_argument(
        "--load-failure-policy",
        choices=("recompute", "fail"),
        help="with --kv-connector pd --load-failures: vLLM's kv_load_failure_policy, what a request whose load failed "
        "does: recompute what the load did not fill (default), or finish with an error (docs/scheduler-connectors.md)",
    )
    group.add_argument(
        "--skip-prefix-reads",
        action="store_true",
        default=None,
        help="a quarter of the requests skip reading the prefix cache (vLLM's skip_reading_prefix_cache, as a request "
        "asking for prompt logprobs does): they must get no hit (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--retention",
        choices=("semantic", "dense", "periodic"),
        help="with a sliding-window model or mamba-hybrid: vLLM's prefix_cache_retention_interval, which of those "
        "groups' blocks the prefix cache keeps: the resume checkpoints (semantic, vLLM's default), every block (dense) "
        "or also one every four blocks (periodic; sliding-window models only) (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--cache-salts",
        action="store_true",
        default=None,
        help="draw each request with a cache salt (or none): the prefix cache must not share blocks across salts",
    )
    group.add_argument(
        "--stop-tokens",
        action="store_true",
        default=None,
        help="draw each request with stop token ids: it ends at the first one sampled",
    )
    group.add_argument(
        "--eos",
        action="store_true",
        default=None,
        help="draw each request ending at the model's EOS token or ignoring it (ignore_eos)",
    )
    group.add_argument(
        "--min-tokens",
        action="store_true",
        default=None,
        help="draw each request with min_tokens: no stop token or EOS is sampled before that many outputs",
    )
    group.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help="LoRA: vLLM's max_loras N (adapters a step may serve), each request drawn with one of N + 1 adapters or "
        "none; the prefix cache must not share blocks across adapters (default: no LoRA)",
    )
    group.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        metavar="N",
        help="vLLM's long_prefill_token_threshold: with other requests in the engine, at most N tokens a request and "
        "step (default: no cap)",
    )
    group.add_argument(
        "--long-prefill-token-threshold-adaptive",
        action="store_true",
        default=None,
        help="floor that cap at a fair share of the token budget (vLLM's long_prefill_token_threshold_adaptive)",
    )
    group.add_argument(
        "--max-num-active-seqs",
        type=int,
        metavar="N",
        help="vLLM's max_num_active_seqs: admit at most N requests to run, at most --max-num-seqs (default: unset)",
    )
    group.add_argument(
        "--prefill-schedule-interval",
        type=int,
        metavar="N",
        help="vLLM's prefill_schedule_interval: while a decode runs, prefill only every N executed steps (default: 1, "
        "every step)",
    )
    group.add_argument(
        "--pauses",
        action="store_true",
        default=None,
        help="the client pauses (new requests, or everything) and unpauses the scheduler between steps "
        "(docs/scheduler-features.md)",
    )
    group.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        default=None,
        help="vLLM's enable_chunked_prefill off: a waiting request's prompt is scheduled whole or not at all "
        "(max_model_len capped at the token budget, as vLLM asks; docs/oracles.md)",
    )
    group.add_argument(
        "--mamba-checkpoints",
        action="store_true",
        default=None,
        help="with --model mamba-hybrid and prefix caching: its Mamba layers export prefill checkpoints from inside "
        "the forward pass, as vLLM's Mamba2 mixer does (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--prefix-resets",
        action="store_true",
        default=None,
        help="the client resets the prefix cache between steps (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--kv-events",
        action="store_true",
        default=None,
        help="vLLM's KV cache events on, checked against the block pool (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--kv-events-full",
        action="store_true",
        default=None,
        help="with --kv-events: half the requests ask for full reports (kv_cache_report_mode=full), whose reused "
        "cached blocks vLLM announces too",
    )
    group.add_argument(
        "--overlong-requests",
        action="store_true",
        default=None,
        help="draw requests whose prompt and max_tokens run past max_model_len (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--stats",
        action="store_true",
        default=None,
        help="vLLM's scheduler stats on (log_stats), checked against the pool (docs/scheduler-features.md)",
    )
    group.add_argument(
        "--prefix-match-unit",
        type=int,
        metavar="N",
        help="vLLM's prefix_match_unit: prefix-cache hashes every N tokens, below the block size, so hits may end "
        "inside a block (partial prefix caching; with --model mamba-hybrid; docs/scheduler-features.md)",
    )
    group.add_argument(
        "--sessions",
        action="store_true",
        default=None,
        help="draw resumable requests (streaming sessions) and the client's new input to them "
        "(docs/scheduler-features.md)",
    )
    group.add_argument(
        "--drafter",
        choices=("ngram", "draft-model", "parallel", "eagle", "eagle-drop"),
        help="with --speculative-tokens: how vLLM is told the drafts are made: its n-gram method (default), a draft "
        "model (one draft slot a request in the input budget, K lookahead slots), a parallel one (K draft slots; "
        "vLLM 0.33.0's V1 runner only) or an EAGLE head, with lookahead block hashes (eagle) or with a hit's last "
        "block dropped (eagle-drop) (docs/scheduler-async.md#drafting-slots)",
    )


def usage_error(args: argparse.Namespace) -> Optional[str]:
    """The one line a ``kvfuzz run`` with these arguments is refused with, if any."""
    if args.scheduler is None:
        given = [name for name in SCHEDULER_ONLY if getattr(args, name) is not None]
        if given:
            return f"--{given[0].replace('_', '-')} needs --scheduler"
        return None
    for attribute, default, flag in _ALLOCATOR_ONLY:
        if getattr(args, attribute) != default:
            return f"--scheduler does not take {flag} (yet; docs/scheduler.md says what a scheduler target covers)"
    from kvfuzz.scheduler.engines import engine_problem

    if args.scheduler == "sglang":
        for name in (
            "isolate",
            "policy",
            "model",
            "write_path",
            "attention",
            "async_scheduling",
            "speculative_tokens",
            "cache_salts",
            "stop_tokens",
            "min_tokens",
            "kv_connector",
            "transfer_delay",
            "load_failures",
            "load_failure_policy",
            "skip_prefix_reads",
            "retention",
            "max_loras",
            "prefix_resets",
            "kv_events",
            "kv_events_full",
            "overlong_requests",
            "stats",
            "prefix_match_unit",
            "sessions",
            "drafter",
            "long_prefill_token_threshold",
            "long_prefill_token_threshold_adaptive",
            "max_num_active_seqs",
            "prefill_schedule_interval",
            "pauses",
            "no_chunked_prefill",
            "mamba_checkpoints",
        ):
            if getattr(args, name) not in (None, False):
                return f"--scheduler sglang does not take --{name.replace('_', '-')} (yet; docs/sglang.md)"

        return engine_problem("sglang", bool(args.untested_engine))
    if args.max_loras is not None and args.max_loras < 1:
        return f"--max-loras must be at least 1, got {args.max_loras} (leave it out for no LoRA)"
    if args.model == "rswa" and args.attention not in (None, "off"):
        return (
            "--model rswa takes no --attention (yet): the attention check reads one run of positions per token, and "
            "an R-SWA token reads two (the prompt and its window); the content check holds both"
        )
    return engine_problem(args.scheduler, bool(args.untested_engine))


def one_line(error: ValueError) -> str:
    """A configuration error in one line: pydantic's (vLLM's configs) is several, its reason on the line that says
    ``Value error,``."""
    lines = str(error).splitlines()
    reason = next((line for line in lines if "Value error, " in line), lines[0] if lines else repr(error))
    return reason.split("Value error, ", 1)[-1].split(" [type=", 1)[0].strip()


def _setup(args: argparse.Namespace) -> SchedulerSetup:
    from kvfuzz.scheduler.config import SchedulerSetup

    chosen = {
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "prefix_caching": False if args.no_prefix_caching else None,
        "policy": args.policy,
        "model": args.model,
        "speculative_tokens": args.speculative_tokens,
        "async_scheduling": True if args.async_scheduling else None,
        "cache_salts": True if args.cache_salts else None,
        "stop_tokens": True if args.stop_tokens else None,
        "eos": True if args.eos else None,
        "min_tokens": True if args.min_tokens else None,
        "kv_connector": args.kv_connector,
        "transfer_delay": args.transfer_delay,
        "load_failures": True if args.load_failures else None,
        "load_failure_policy": args.load_failure_policy,
        "skip_prefix_reads": True if args.skip_prefix_reads else None,
        "retention": args.retention,
        "max_loras": args.max_loras,
        "prefix_resets": True if args.prefix_resets else None,
        "kv_events": True if args.kv_events else None,
        "kv_events_full": True if args.kv_events_full else None,
        "overlong_requests": True if args.overlong_requests else None,
        "stats": True if args.stats else None,
        "prefix_match_unit": args.prefix_match_unit,
        "sessions": True if args.sessions else None,
        "drafter": args.drafter,
        "long_prefill_token_threshold": args.long_prefill_token_threshold,
        "long_prefill_token_threshold_adaptive": True if args.long_prefill_token_threshold_adaptive else None,
        "max_num_active_seqs": args.max_num_active_seqs,
        "prefill_schedule_interval": args.prefill_schedule_interval,
        "pauses": True if args.pauses else None,
        "chunked_prefill": False if args.no_chunked_prefill else None,
        "mamba_checkpoints": True if args.mamba_checkpoints else None,
    }
    return SchedulerSetup(
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        **{name: value for name, value in chosen.items() if value is not None},
    )


def _prepare(args: argparse.Namespace) -> None:
    """Before vLLM is imported: Triton's interpreter for vLLM's slot mapping kernels or its Triton attention."""
    from kvfuzz.scheduler.write_paths import prepare_write_path

    prepare_write_path(args.write_path or "kvfuzz")
    if args.attention == "vllm-triton":
        from kvfuzz.kernels.vllm_triton import prepare
        from kvfuzz.scheduler.config import MODEL_SHAPE

        prepare(MODEL_SHAPE)


def _paths(args: argparse.Namespace) -> str:
    """The write path and attention check, for the run's header."""
    return f"\n  write path {args.write_path or 'kvfuzz'}, attention {args.attention or 'off'}"


def _worker(args: argparse.Namespace) -> WorkerFactory:
    """The worker of each example: the chosen write path and attention check."""

    from kvfuzz.scheduler.attention import ATTENTIONS
    from kvfuzz.scheduler.worker import Worker
    from kvfuzz.scheduler.write_paths import WRITE_PATHS

    attention = ATTENTIONS[args.attention or "off"]
    return lambda chosen: Worker(chosen, WRITE_PATHS[args.write_path or "kvfuzz"], attention(chosen.block_size))


Body = Callable[[Optional["Journal"]], "Ran"]
"""The run's search and report, given the journal that keeps each example's program on disk (None: none)."""

Isolator = Callable[[Body, argparse.Namespace], "Ran"]
"""Runs a :data:`Body` in a child process and reports the child's death as a finding (``--isolate``; the campaign
layer's, handed in by the command, since this module sits below it)."""


@attrs.frozen
class Ran:
    """What a run ended with: its exit status, and (with ``--json``) the object standard output gets."""

    status: int
    json: Optional[dict[str, Any]] = None


def run_scheduler(
    args: argparse.Namespace,
    emit_json: Callable[[Any], None],
    isolator: Optional[Isolator] = None,
    database: Optional[ExampleDatabase] = None,
) -> int:
    """``kvfuzz run --scheduler``: exit status 0 (passed), 1 (a check failed), 2 (a usage error). With ``--json``
    the outcome goes to ``emit_json`` (the CLI's, which keeps standard output for it). With ``--isolate`` the
    examples run under ``isolator``, which the command hands in. With ``database`` (``--database``, opened by the
    command) the search is random and keeps its failing examples there, trying them first the next time."""
    problem = usage_error(args)
    if problem is None and args.scheduler == "sglang":
        from kvfuzz.scheduler.sglang.command import run_sglang, setup_problem

        try:
            setup = _setup(args)
            problem = setup_problem(setup)
        except ValueError as error:
            problem = str(error)
        if problem is None:
            return run_sglang(args, setup, emit_json, database)
    if problem is None:
        try:
            setup = _setup(args)
            _prepare(args)  # Triton's interpreter, before vLLM (and so Triton) is imported
            from kvfuzz.scheduler.vllm_build import vllm_config

            started = time.perf_counter()
            vllm_config(setup)  # vLLM's own validation of the configuration, before any work
            configured = time.perf_counter() - started
        except ValueError as error:
            problem = one_line(error)
    if problem is not None:
        print(f"kvfuzz: {problem}", file=sys.stderr)
        return 2
    from kvfuzz.scheduler.engines import VLLM, untested_warning
    from kvfuzz.scheduler.search import search_kind

    warning = untested_warning(args.scheduler)
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    if not args.json:
        print(
            f"kvfuzz run: --scheduler {args.scheduler} ({SCHEDULERS[args.scheduler]}, vLLM {VLLM.installed()}; "
            f"imported and configured in {configured:.1f} s)\n  {setup.describe()}\n  "
            f"{plural(args.examples, 'example')} of up to {plural(args.steps, 'operation')}, "
            f"{search_kind(args.seed, args.database)}; "
            + (f"a step running past {args.call_timeout:g} s is a hang" if args.call_timeout else "no watchdog")
            + (", the examples in a child process (--isolate)" if args.isolate else "")
            + _paths(args),
            flush=True,
        )

    def body(journal: Optional[Journal]) -> Ran:
        return _search_and_report(args, setup, configured, journal, database)

    ran = isolator(body, args) if args.isolate and isolator is not None else body(None)
    if ran.json is not None:
        emit_json(ran.json)
    return ran.status


def _search_and_report(
    args: argparse.Namespace,
    setup: SchedulerSetup,
    configured: float,
    journal: Optional[Journal],
    database: Optional[ExampleDatabase],
) -> Ran:
    """The examples, their outcome printed (or, with ``--json``, returned), and the failure's trace saved."""
    from pathlib import Path

    from kvfuzz.scheduler.recorder import FailureRecorder
    from kvfuzz.scheduler.replay import bounded_replay
    from kvfuzz.scheduler.search import search
    from kvfuzz.scheduler.shrinking import shrink_drifted
    from kvfuzz.trace_saving import NO_TRACE_FIELDS

    recorder = FailureRecorder(args.scheduler, Path(args.corpus))
    outcome = search(
        setup,
        examples=args.examples,
        steps=args.steps,
        shrink=not args.no_shrink,
        worker=_worker(args),
        witness=recorder,
        seed=args.seed,
        call_timeout=args.call_timeout or None,
        journal=journal,
        database=database,
    )
    if not args.json:
        print("\n".join(outcome.describe()), flush=True)
    if outcome.harness is not None:
        return _harness_error(args, outcome)
    saved = recorder.finish(outcome.failure, shrunk=not args.no_shrink)
    emitted: Optional[dict[str, Any]] = None
    if args.json:
        if saved is not None and saved.error is not None:
            print(f"kvfuzz: trace NOT saved: cannot write {saved.path} ({saved.error})", file=sys.stderr)
        emitted = {
            "scheduler": args.scheduler,
            "seed": args.seed,
            "configure_seconds": round(configured, 3),
            **outcome.to_json(),
            **(NO_TRACE_FIELDS if saved is None else saved.json_fields()),
        }
    elif saved is not None:
        print(f"\n{saved.report()}", flush=True)
    call_timeout = args.call_timeout or None
    drifted = shrink_drifted(recorder.first, saved, lambda trace: bounded_replay(trace, call_timeout))
    if drifted is not None:
        print(drifted, file=sys.stderr, flush=True)
    return Ran(1 if outcome.failure is not None else 0, emitted)


def _harness_error(args: argparse.Namespace, outcome: Any) -> Ran:
    """A search stopped by a harness error: its traceback and hint on standard error, nothing saved, exit status 3
    (``--json``: the outcome, with its ``harness_error`` line)."""
    from kvfuzz.scheduler.harness import HARNESS_STATUS

    print(outcome.harness.describe(), file=sys.stderr, flush=True)
    emitted = {"scheduler": args.scheduler, "seed": args.seed, **outcome.to_json()} if args.json else None
    return Ran(HARNESS_STATUS, emitted)
