"""A vLLM scheduler trace as a standalone reproducer: one Python file that imports vLLM, torch and the standard
library only (never kvfuzz), builds vLLM's ``Scheduler`` offline from vLLM's own config objects (a ``config.json``
written into a temporary directory), plays the client's adds, aborts and steps as straight-line calls, the model's
outputs as kvfuzz's fake model samples them (the tokens and drafts written into the file as tables), then the drain,
and raises ``AssertionError`` where kvfuzz's check failed. It runs as a script (exit status 1 while the bug
reproduces, 0 once fixed) and as a pytest file.

Only failures that the engine's own state shows are expressed: the accounting check (block ``ref_cnt`` and the
free count against the tables the scheduler handed out), progress (requests unfinished past the drain's bound), an
exception of vLLM's own, and on the R-SWA model a position the model runner attends mapped to the null block (the
prompt, as the runner's ``prompt_lens`` has it, and the window: vLLM's tables alone show it). Checks that need
kvfuzz's K/V reference (content, outputs, speculative rollback) are refused with the reason
(:class:`NotReproducible`), as are configurations the reproducer's runner does not play
(async scheduling, load failures, a streaming session's later turns under min_tokens: its turns are played as the
client sends them, each session going on while vLLM keeps it). The Mamba hybrid is built as the target builds it, by
vLLM's own KV-cache planner, with partial prefix-cache hits and KV cache events (published nowhere: the
reproducer checks no event) where the trace has them; its accounting, which reads one KV-cache group, is stated for
the full-attention model only."""

from __future__ import annotations

import json
import re
from typing import Callable

from kvfuzz.reproducer_text import NotReproducible, comment
from kvfuzz.scheduler.config import MODEL_SHAPE
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.fake_model import EOS_TOKEN
from kvfuzz.scheduler.kv_events import full_reports
from kvfuzz.scheduler.models import FULL, MAMBA_HYBRID, MODELS, RSWA, RSWAModel
from kvfuzz.scheduler.prefix_reads import skips_reads
from kvfuzz.scheduler.program import Abort, AddRequest, ResetPrefixCache, Resume, Step
from kvfuzz.scheduler.reproducer_runtime import RUNTIME
from kvfuzz.scheduler.speculative import proposal
from kvfuzz.scheduler.trace import CRASH, SGLANG, SchedulerTrace

EXPRESSED = ("accounting", "progress", CRASH)
"""The recorded failures a reproducer states on vLLM's objects."""

NULL_READ = "maps to vLLM's null block 0"
"""The content failure a reproducer states on the R-SWA model's tables: a position its tokens attend (the prompt, or
the window) mapped to vLLM's null block."""

BATCH_EXPRESSED = "neither as a new nor as a cached request"
"""The one batch-check failure a reproducer states on vLLM's ``SchedulerOutput``: the step schedules tokens for a
request the output does not bring (the model runner has no table for it), as a priority victim does (issue #23316)."""


def _refusal(trace: SchedulerTrace) -> str | None:
    """Why ``trace`` gets no reproducer (None: it gets one)."""
    setup = trace.setup
    if trace.scheduler == SGLANG:
        return "an sglang trace: its reproducer is kvfuzz.reproducers.sglang_scheduler's, not this vLLM one"
    null_read = setup.model == RSWA.name and trace.failure.check == "content" and NULL_READ in trace.failure.message
    if trace.failure.check == "batch" and BATCH_EXPRESSED in trace.failure.message or null_read:
        pass
    elif trace.failure.check not in EXPRESSED:
        return (
            f"its failure is kvfuzz's {trace.failure.check} check, which compares with kvfuzz's reference: a "
            f"reproducer states only {', '.join(EXPRESSED)} on vLLM's own objects"
        )
    if setup.async_scheduling:
        return "async scheduling (two batches in flight) is not played by the reproducer's engine loop"
    if setup.model not in (FULL.name, MAMBA_HYBRID.name, RSWA.name):
        return f"model {setup.model}: the reproducer builds the full-attention model, the Mamba hybrid and R-SWA only"
    if setup.model != FULL.name and trace.failure.check not in (CRASH, "progress") and not null_read:
        return f"model {setup.model}: the reproducer states accounting on one KV-cache group (the full model's) only"
    if setup.load_failures:
        return "failed loads are not played by the reproducer's connector"
    if setup.kv_connector == "pd":
        return "kvfuzz's P/D connector is not played by the reproducer (it plays vLLM's OffloadingConnector only)"
    if setup.overlong_requests:
        return "requests past max_model_len are not played by the reproducer"
    if setup.stats:
        return "the scheduler stats check is not played by the reproducer"
    if setup.min_tokens and any(isinstance(operation, Resume) for operation in trace.program):
        return "a streaming session's later turns under min_tokens: the reproducer's token tables mask a first turn's"
    if setup.pauses:
        return "the client's pauses are not played by the reproducer"
    if setup.retention != "semantic":
        return f"the {setup.retention} prefix-cache retention is not configured by the reproducer"
    if setup.drafter != "ngram":
        return f"the {setup.drafter} drafter: the reproducer configures vLLM's n-gram method only"
    return None


def check_reproducible(trace: SchedulerTrace) -> None:
    """Raise :class:`NotReproducible` unless a reproducer can be generated for ``trace``."""
    reason = _refusal(trace)
    if reason is not None:
        raise NotReproducible(reason)


def _tables(trace: SchedulerTrace) -> tuple[dict[str, list[int]], dict[str, dict[int, list[int]]]]:
    """The fake model's token at every position of each request (its min-tokens processor applied), and the drafts
    the worker proposes for it at every sequence length (empty without speculative decoding)."""
    setup = trace.setup
    k = setup.speculative_tokens
    end = setup.max_model_len + k + 2
    sampled: dict[str, list[int]] = {}
    drafts: dict[str, dict[int, list[int]]] = {}
    adds = [operation for operation in trace.program if isinstance(operation, AddRequest)]
    for index, add in enumerate(adds):
        request = f"r{index}"
        sampler = Ending(add.stop_token_ids, add.eos, add.min_tokens).sampler
        sampled[request] = [sampler.token(request, len(add.prompt), position) for position in range(end)]
        if k:
            drafts[request] = {length: proposal(request, length, k) for length in range(len(add.prompt) + 1, end)}
    return sampled, drafts


def program_calls(trace: SchedulerTrace, add: Callable[[AddRequest, str], str]) -> list[str]:
    """The reproducer's calls on its ``engine``, one per operation of the trace's program: ``add`` writes an add's
    call (its request named ``r0``, ``r1``, ... in order, as the target names them), each engine its own way."""
    calls: list[str] = []
    added = 0
    for operation in trace.program:
        if isinstance(operation, AddRequest):
            calls.append(add(operation, f"r{added}"))
            added += 1
        elif isinstance(operation, (Abort, Step, ResetPrefixCache, Resume)):
            calls.append(operation.source("engine"))
        else:
            raise NotReproducible(f"the reproducer's engine does not play {operation.source('engine')}")
    return calls


def _adder(trace: SchedulerTrace) -> Callable[[AddRequest, str], str]:
    """How the reproducer writes an add: its request's id first, whether it asks for full KV cache event reports
    (half the requests, as kvfuzz's client asks, :func:`~kvfuzz.scheduler.kv_events.full_reports`) and whether it
    skips reading the prefix cache (:func:`~kvfuzz.scheduler.prefix_reads.skips_reads`)."""

    def add(operation: AddRequest, request: str) -> str:
        call = operation.source("engine").replace("engine.add(", f'engine.add("{request}", ', 1)[:-1]
        call += ", full_reports=True" if full_reports(trace.setup, request) else ""
        return call + (", skip_reads=True)" if skips_reads(trace.setup, request) else ")")

    return add


def reproducer_source(trace: SchedulerTrace, source: str) -> str:
    """The reproducer's text (``source``: the trace file, as named). Raises :class:`NotReproducible`."""
    check_reproducible(trace)
    setup = trace.setup
    sampled, drafts = _tables(trace)
    name = re.sub(r"[^a-z0-9]+", "_", f"{trace.scheduler} {trace.failure.check} {trace.digest()}".lower())
    kv_bytes_per_block = 2 * MODEL_SHAPE.num_layers * MODEL_SHAPE.num_kv_heads * MODEL_SHAPE.head_dim * 4
    offload = (
        f"{setup.num_blocks} * (-(-{kv_bytes_per_block * setup.block_size} // mmap.PAGESIZE) * mmap.PAGESIZE)"
        if setup.kv_connector == "offloading"
        else "0"
    )
    body = "\n".join(f"    {call}" for call in program_calls(trace, _adder(trace)))
    known = f"{comment('Known bug: ' + trace.known_bug)}\n" if trace.known_bug else ""
    model = MODELS[setup.model]
    rswa_window = model.rswa_window(setup.block_size) if isinstance(model, RSWAModel) else 0
    expectation = {
        "progress": "a request never finishes: engine.drain() raises Failure('progress: ...')",
        "accounting": "the block pool disagrees with the tables handed out: engine.step() raises "
        "Failure('accounting at step ...')",
        CRASH: f"vLLM raises {trace.failure.exception}",
        "batch": "the step schedules tokens for a request its output does not bring: engine.step() raises "
        "Failure('batch at step ...')",
        "content": "a position the model runner attends maps to vLLM's null block: engine.step() raises "
        "Failure('content at step ...')",
    }[trace.failure.check]
    return f'''"""Standalone reproducer of a vLLM scheduler failure kvfuzz found (generated by kvfuzz report from
{source.replace(chr(92), "/").replace('"""', "")}). It imports vLLM, torch and the standard library only.

Run it where vLLM is installed: python THIS_FILE (exit status 1 and the failure while it reproduces, 0 once fixed),
or pytest THIS_FILE. Recorded against vLLM {trace.vllm_version}, the {trace.model_runner} model runner's protocol.
Expected while the bug is there: {expectation}.
"""

{comment("Recorded failure: " + trace.failure.describe())}
{known}
import mmap

# ---- the trace's configuration (kvfuzz: {setup.describe()}) ----
MODEL_RUNNER = {trace.model_runner!r}
NUM_BLOCKS = {setup.num_blocks}  # usable blocks; vLLM gets one more, its null block 0
BLOCK_SIZE = {setup.block_size}
MAX_NUM_BATCHED_TOKENS = {setup.max_num_batched_tokens}
MAX_NUM_SEQS = {setup.max_num_seqs}
MAX_MODEL_LEN = {setup.max_model_len}  # a request alone always fits: vLLM's startup check admits it on the pool
CHUNKED_PREFILL = {setup.chunked_prefill}  # off: a prompt is scheduled whole (MAX_MODEL_LEN within the budget)
PREFIX_CACHING = {setup.prefix_caching}
PREFIX_MATCH_UNIT = {setup.prefix_match_unit}  # tokens a prefix-cache hash covers, below the block (0: the block)
HASH_BLOCK_SIZE = {setup.hash_block_size}  # tokens a prefix-cache hash covers
KV_EVENTS = {setup.kv_events}  # KV cache events on, published nowhere (an add's full_reports asks for full reports)
POLICY = {setup.policy!r}
SPECULATIVE_TOKENS = {setup.speculative_tokens}  # n-gram method: the scheduler sees only the number of drafts
MAX_LORAS = {setup.max_loras}
LONG_PREFILL_TOKEN_THRESHOLD = {setup.long_prefill_token_threshold}  # 0: no cap
LONG_PREFILL_TOKEN_THRESHOLD_ADAPTIVE = {setup.long_prefill_token_threshold_adaptive}
MAX_NUM_ACTIVE_SEQS = {setup.max_num_active_seqs or None}  # None: max_num_seqs
PREFILL_SCHEDULE_INTERVAL = {setup.prefill_schedule_interval}  # prefill every N executed steps while a decode runs
OFFLOAD_BYTES = {offload}  # vLLM's OffloadingConnector over as many chunks as blocks (0: no connector)
TRANSFER_DELAY = {setup.transfer_delay}  # the most steps a transfer job completes late
EOS_TOKEN = {EOS_TOKEN}
KV_HEADS = {MODEL_SHAPE.num_kv_heads}
HEAD_DIM = {MODEL_SHAPE.head_dim}
MODEL = {setup.model!r}  # {model.description}
MAMBA_CHECKPOINTS = {setup.mamba_checkpoints}  # the Mamba layers export prefill checkpoints, as a Mamba2 mixer does
RSWA_WINDOW = {rswa_window}  # the R-SWA layers' window (0: no R-SWA layers)
HF_CONFIG = {json.dumps(model.hf_config(MODEL_SHAPE, 1 if model is FULL else setup.block_size))}

# ---- the fake model: the token it samples for a request at each position, the drafts proposed at each length ----
SAMPLED = {json.dumps(sampled)}
DRAFTS = {{request: {{int(length): drafts for length, drafts in by_length.items()}}
          for request, by_length in {json.dumps(drafts)}.items()}}
{RUNTIME}

# ---- the client's program, then the drain ----
def test_{name.strip("_")}():
    engine = Engine()
{body}
    engine.drain()


if __name__ == "__main__":
    test_{name.strip("_")}()
    print("passed: the failure does not reproduce")
'''
