"""A scheduler trace as a standalone pytest file: the recorded configuration and model runner, the client's
operations as calls on a :class:`~kvfuzz.scheduler.session.Session`, then the drain. It fails (the check's
violation, or vLLM's own exception) while the failure reproduces, and passes once it is fixed; run it where vLLM is
installed (without it the test fails on the import, loudly). An ``sglang`` trace's file plays the same operations on
an SGLang session, to run in SGLang's environment."""

from __future__ import annotations

import textwrap

from kvfuzz.exported_test import known_bug_note, pytest_file
from kvfuzz.scheduler.trace import SGLANG, SchedulerTrace


def export_test(trace: SchedulerTrace, source: str) -> str:
    """The pytest file's text (its frame :mod:`kvfuzz.exported_test`'s)."""
    setup = trace.setup
    calls = "\n".join(f"        {operation.source('session')}" for operation in trace.program)
    if trace.scheduler == SGLANG:
        return _export_sglang(trace, source)
    runner_v2 = trace.model_runner == "V2"
    model = f", model={setup.model!r}" if setup.model != "full" else ""
    speculative = f", speculative_tokens={setup.speculative_tokens}" if setup.speculative_tokens else ""
    speculative += f", drafter={setup.drafter!r}" if setup.drafter != "ngram" else ""
    loras = f", max_loras={setup.max_loras}" if setup.max_loras else ""
    unit = f", prefix_match_unit={setup.prefix_match_unit}" if setup.prefix_match_unit else ""
    connector = f", kv_connector={setup.kv_connector!r}" if setup.kv_connector != "none" else ""
    delay = f", transfer_delay={setup.transfer_delay}" if setup.transfer_delay else ""
    options = model + speculative + loras + unit + connector + delay
    options += ", chunked_prefill=False" if not setup.chunked_prefill else ""
    options += ", mamba_checkpoints=True" if setup.mamba_checkpoints else ""
    options += "".join(
        f", {name}={value!r}"
        for name, value in (
            ("long_prefill_token_threshold", setup.long_prefill_token_threshold),
            ("long_prefill_token_threshold_adaptive", setup.long_prefill_token_threshold_adaptive),
            ("max_num_active_seqs", setup.max_num_active_seqs),
            ("prefill_schedule_interval", setup.prefill_schedule_interval * (setup.prefill_schedule_interval > 1)),
            ("load_failure_policy", setup.load_failure_policy if setup.load_failure_policy != "recompute" else ""),
            ("retention", setup.retention if setup.retention != "semantic" else ""),
        )
        if value
    )
    drawn = {
        "async_scheduling": setup.async_scheduling,
        "cache_salts": setup.cache_salts,
        "stop_tokens": setup.stop_tokens,
        "eos": setup.eos,
        "min_tokens": setup.min_tokens,
        "prefix_resets": setup.prefix_resets,
        "kv_events": setup.kv_events,
        "kv_events_full": setup.kv_events_full,
        "overlong_requests": setup.overlong_requests,
        "stats": setup.stats,
        "sessions": setup.sessions,
        "load_failures": setup.load_failures,
        "skip_prefix_reads": setup.skip_prefix_reads,
        "pauses": setup.pauses,
    }
    export_async = "".join(f", {name}=True" for name, on in drawn.items() if on)
    imports = """from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.replay import model_runner
from kvfuzz.scheduler.session import Session"""
    body = f"""    setup = SchedulerSetup(num_blocks={setup.num_blocks}, block_size={setup.block_size},
                           max_num_batched_tokens={setup.max_num_batched_tokens}, max_num_seqs={setup.max_num_seqs},
                           prefix_caching={setup.prefix_caching}, policy={setup.policy!r}{options}{export_async})
    with model_runner({trace.model_runner!r}):
        session = Session(setup)
        assert session.worker.runner_v2 is {runner_v2}, "vLLM did not select the recorded model runner"
{calls}
        session.drain()"""
    recorded = f"of {trace.scheduler} (vLLM {trace.vllm_version}, {trace.model_runner} model runner)"
    return pytest_file(source, recorded, _failure(trace), known_bug_note(trace.known_bug), imports, *_name(trace), body)


def _failure(trace: SchedulerTrace) -> str:
    return textwrap.indent(trace.failure.describe(), "    ")


def _name(trace: SchedulerTrace) -> tuple[str, str]:
    """The test's name: the scheduler and the check, then the trace's digest."""
    return f"{trace.scheduler} {trace.failure.check}", trace.digest()


def _export_sglang(trace: SchedulerTrace, source: str) -> str:
    """The pytest file of an ``sglang`` trace: an :class:`~kvfuzz.scheduler.sglang.session.SGLangSession` of the
    recorded configuration (run it in SGLang's environment)."""
    setup = trace.setup
    calls = "\n".join(f"    {operation.source('session')}" for operation in trace.program)
    imports = """from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.sglang.session import SGLangSession"""
    body = f"""    setup = SchedulerSetup(num_blocks={setup.num_blocks}, block_size={setup.block_size},
                           max_num_batched_tokens={setup.max_num_batched_tokens}, max_num_seqs={setup.max_num_seqs},
                           prefix_caching={setup.prefix_caching})
    session = SGLangSession(setup)
{calls}
    session.drain()"""
    recorded = f"of {trace.scheduler} (SGLang {trace.vllm_version})"
    return pytest_file(source, recorded, _failure(trace), known_bug_note(trace.known_bug), imports, *_name(trace), body)
