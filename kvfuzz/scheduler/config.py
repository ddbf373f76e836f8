"""What one scheduler target is built with: the pool, the token budget, the running-request cap, prefix caching, the
scheduling policy, synchronous or async scheduling, LoRA adapters, KV cache events; and which request fields the
machine draws besides prompt, length and priority (cache salts, stop tokens, EOS, min_tokens, a LoRA adapter, a
length past max_model_len, resumable) and whether the client resets the prefix cache; the prefix-cache hash
granularity (partial prefix caching); and SGLang's schedule conservativeness."""

from __future__ import annotations

import attrs

from kvfuzz.reference.content import ModelShape
from kvfuzz.scheduler.async_batches import DEPTH
from kvfuzz.scheduler.models import CHECKPOINT_BLOCKS, MODELS, max_model_len

POLICIES = ("fcfs", "priority")
"""vLLM's scheduling policies: first come first served, or by each request's priority (smaller first, then arrival)."""

LOAD_FAILURE_POLICIES = ("recompute", "fail")
"""vLLM's ``kv_load_failure_policy``: a request whose KV load failed recomputes what the load did not fill, or
finishes with an error (:mod:`kvfuzz.scheduler.disaggregation`)."""

RETENTIONS = ("semantic", "dense", "periodic")
"""vLLM's ``prefix_cache_retention_interval``, what a sliding-window or Mamba group keeps in the prefix cache:
``semantic`` (0, vLLM's default) only the checkpoints a later request can resume at (a prompt's replay boundary);
``dense`` (None) every block; ``periodic`` besides those, one every four blocks (on the sliding-window model only, whose
scheduler block is its block; a Mamba hybrid's spans its Mamba block)."""

DRAFTERS = ("ngram", "draft-model", "parallel", "eagle", "eagle-drop")
"""How vLLM is told the drafts are made (kvfuzz's worker proposes them all the same,
:mod:`kvfuzz.scheduler.speculative`): its n-gram method (no draft slots, no lookahead), a draft model
(``draft_model``: one draft slot per request in the input budget, ``k`` lookahead slots allocated), or a parallel
draft model (PARD, ``parallel_drafting``: ``k`` draft slots; vLLM 0.33.0's V1 runner only), or an EAGLE head, whose
draft K/V at a position is computed from the next token as well (:mod:`kvfuzz.scheduler.eagle`): ``eagle`` with
vLLM's default for it under prefix caching, block hashes that cover the token after each block (lookahead hashes),
``eagle-drop`` with those off (``disable_lookahead_block_hashes``), so that vLLM drops a prefix-cache hit's last block
instead (docs/scheduler-async.md#drafting-slots, #eagle-drafts)."""

KV_CONNECTORS = ("none", "offloading", "pd")
"""KV connectors the target drives: none, vLLM's OffloadingConnector (kvfuzz.scheduler.offloading), or kvfuzz's
P/D-disaggregation connector, a remote producer's loads and sends to a remote decoder (kvfuzz.scheduler.pd_connector,
kvfuzz.scheduler.disaggregation)."""

MAX_LORAS = 4
"""The most LoRA adapters a step may serve (``max_loras``) the target is built with: requests draw from one adapter
more than that (:func:`kvfuzz.scheduler.requests.lora_adapters`), so the limit can bite."""

MAX_SCHEDULE_CONSERVATIVENESS = 10.0
"""The largest ``schedule_conservativeness`` a setup takes (SGLang reserves at most every remaining token anyway)."""

MAX_PREFILL_SCHEDULE_INTERVAL = 16
"""The longest prefill cadence a setup takes, in executed steps."""

MODEL_SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=2, head_dim=4)
"""The K/V kvfuzz writes for every scheduled token: small, since only its content is compared, never attended."""


@attrs.frozen
class SchedulerSetup:
    """One configuration of vLLM's v1 ``Scheduler``.

    Invariants: the pool holds ``num_blocks`` blocks of ``block_size`` slots besides vLLM's null block, and no
    request is longer than the pool (``max_model_len``), so that a request alone in the engine always fits, as vLLM
    checks at startup for a real model."""

    num_blocks: int = 16  # usable blocks of the pool (vLLM gets one more, its null block 0)
    block_size: int = 4  # slots per block
    max_num_batched_tokens: int = 16  # the step's token budget: prompts longer than it are prefilled in chunks
    max_num_seqs: int = 4  # most requests running at once
    prefix_caching: bool = True  # vLLM's automatic prefix caching
    policy: str = "fcfs"  # vLLM's scheduling policy: "fcfs" or "priority" (kvfuzz.scheduler.priority)
    model: str = "full"  # the model served: its KV-cache groups (kvfuzz.scheduler.models)
    speculative_tokens: int = 0  # k: the most drafts scheduled per request and step (0: no speculative decoding)
    async_scheduling: bool = False  # vLLM's AsyncScheduler, driven with two batches in flight (async_batches.py)
    cache_salts: bool = False  # requests drawn with a cache salt, or none (kvfuzz.scheduler.requests)
    stop_tokens: bool = False  # requests drawn with stop token ids (kvfuzz.scheduler.requests)
    eos: bool = False  # requests drawn ending at the model's EOS token, or ignoring it (kvfuzz.scheduler.ending)
    min_tokens: bool = False  # requests drawn with min_tokens: no stop token or EOS sampled before (ending.py)
    # "offloading": vLLM's OffloadingConnector, its worker side kvfuzz's (offloading.py); "pd": kvfuzz's P/D
    # connector (pd_connector.py, disaggregation.py), which under async scheduling turns vLLM's deferred frees on
    kv_connector: str = "none"
    transfer_delay: int = 0  # with a connector: the most steps a store or load completes late
    load_failures: bool = False  # with a connector: loads may fail part-way (vLLM's recompute recovery)
    # with failed loads (the P/D connector): vLLM's kv_load_failure_policy, what a request whose load failed does
    load_failure_policy: str = "recompute"
    # a quarter of the requests (drawn per id) skip reading the prefix cache (vLLM's skip_reading_prefix_cache, as a
    # request asking for prompt logprobs does): vLLM gives them no hit (kvfuzz.scheduler.prefix_reads)
    skip_prefix_reads: bool = False
    # vLLM's prefix_cache_retention_interval on a sliding-window or Mamba model (RETENTIONS): which of those groups'
    # blocks the prefix cache keeps
    retention: str = "semantic"
    max_loras: int = 0  # LoRA: vLLM's lora_config.max_loras, requests drawn with an adapter (0: no LoRA; lora.py)
    prefix_resets: bool = False  # the client resets the prefix cache between steps (kvfuzz.scheduler.prefix_reset)
    kv_events: bool = False  # vLLM's KV cache events on, checked against the block pool (kvfuzz.scheduler.kv_events)
    # with kv_events: half the requests (drawn per request id) ask for full reports (kv_cache_report_mode "full"):
    # vLLM announces the cached blocks a lookup reuses for them too (kvfuzz.scheduler.kv_events)
    kv_events_full: bool = False
    overlong_requests: bool = False  # requests drawn with prompt + max_tokens past max_model_len (model_length.py)
    stats: bool = False  # vLLM's scheduler stats on (log_stats), checked (kvfuzz.scheduler.stats)
    # vLLM's cache_config.prefix_match_unit: prefix-cache hashes every this many tokens, below the block size, so a
    # Mamba hybrid's hits may end inside a block (partial prefix caching, kvfuzz.scheduler.partial_prefix); 0: unset
    prefix_match_unit: int = 0
    sessions: bool = False  # requests drawn resumable (streaming sessions) and resumed (kvfuzz.scheduler.sessions)
    # SGLang's --schedule-conservativeness: scales the share of each running request's remaining output its
    # PrefillAdder reserves (the new-token ratio); below 1 it overcommits the pool, and decode retracts requests
    schedule_conservativeness: float = 1.0
    drafter: str = "ngram"  # how vLLM is told the drafts are made: its draft slots and lookahead (DRAFTERS)
    # vLLM's long_prefill_token_threshold: with other requests in the engine, no request gets more tokens a step (0:
    # no cap); with long_prefill_token_threshold_adaptive the cap is floored at the token budget's fair share
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    max_num_active_seqs: int = 0  # vLLM's admission cap into RUNNING, at most max_num_seqs (0: unset, max_num_seqs)
    # vLLM's prefill_schedule_interval: prefill (admissions, and chunks of admitted prompts) only every N executed
    # steps while a decode runs, the steps between decode alone (1: every step)
    prefill_schedule_interval: int = 1
    pauses: bool = False  # the client pauses and unpauses the scheduler between steps (kvfuzz.scheduler.pausing)
    # vLLM's enable_chunked_prefill: off, a waiting request's prompt is scheduled whole or not at all (vLLM then asks
    # max_num_batched_tokens >= max_model_len: the target's max_model_len is capped at the budget)
    chunked_prefill: bool = True
    # on a Mamba hybrid with prefix caching: its Mamba layers export prefill checkpoints from inside the forward pass,
    # as vLLM's Mamba2 mixer does (kvfuzz.scheduler.mamba_checkpoints)
    mamba_checkpoints: bool = False

    def __attrs_post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.model == "mamba-hybrid" and self.speculative_tokens:
            raise ValueError(
                "model mamba-hybrid is not driven with speculative decoding: vLLM 0.33.0 accepts the configuration, "
                "but its Jamba's Mamba1 mixer has no draft-verification state path (it ignores num_accepted_tokens), "
                "so there is no runner behaviour to model (docs/scheduler-models.md#mamba-hybrid-models)"
            )
        if self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be >= 0, got {self.speculative_tokens}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if self.drafter != "ngram" and not self.speculative_tokens:
            raise ValueError(f"drafter {self.drafter} needs speculative decoding (speculative_tokens >= 1)")
        if self.drafter.startswith("eagle") and self.model != "full":
            raise ValueError(
                f"drafter {self.drafter} is driven on the full-attention model only (yet): the EAGLE head's layer "
                "would change how vLLM groups a hybrid model's layers, and vLLM has no EAGLE head for the "
                "sliding-window model's Gemma 2 (docs/scheduler-async.md#eagle-drafts)"
            )
        if self.drafter.startswith("eagle") and self.kv_connector == "pd":
            raise ValueError(
                f"drafter {self.drafter} is not driven with the P/D connector (yet): its remote prefill would carry "
                "the EAGLE head's draft K/V, which kvfuzz's P/D worker does not model "
                "(docs/scheduler-async.md#eagle-drafts)"
            )
        if self.min_tokens and self.speculative_tokens:
            raise ValueError(
                "min_tokens under speculative decoding is not driven (yet): kvfuzz's sampler does not mask the drafts "
                "it verifies (docs/scheduler-requests.md#eos-and-min_tokens)"
            )
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {self.kv_connector!r}")
        if self.kv_connector == "none" and (self.transfer_delay or self.load_failures):
            raise ValueError("late transfers and load failures need a KV connector (--kv-connector offloading)")
        if self.retention not in RETENTIONS:
            raise ValueError(f"retention must be one of {', '.join(RETENTIONS)}, got {self.retention!r}")
        sliding = MODELS[self.model].groups_of("sliding") > 0
        if self.retention != "semantic" and not (sliding or self.model == "mamba-hybrid"):
            raise ValueError(
                f"retention {self.retention} needs a sliding-window or Mamba group (--model sliding-window, "
                "sliding-window-groups or mamba-hybrid): vLLM's retention interval applies to those groups only, and "
                "refuses a model without"
            )
        if self.retention == "periodic" and not sliding:
            raise ValueError(
                "retention periodic is driven on the sliding-window models only: vLLM's interval must be a multiple "
                "of the scheduler block, which on a Mamba hybrid spans its Mamba block"
            )
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"load_failure_policy must be one of {', '.join(LOAD_FAILURE_POLICIES)}, got "
                f"{self.load_failure_policy!r}"
            )
        if self.load_failure_policy != "recompute" and not (self.load_failures and self.kv_connector == "pd"):
            raise ValueError(
                f"load_failure_policy {self.load_failure_policy} needs failed loads of the P/D connector "
                "(--kv-connector pd --load-failures; docs/scheduler-connectors.md)"
            )
        if self.transfer_delay < 0:
            raise ValueError(f"transfer_delay must be >= 0, got {self.transfer_delay}")
        if self.kv_connector == "offloading" and (self.async_scheduling or self.model != "full"):
            raise ValueError(
                "the offloading connector is driven only with synchronous scheduling and the full-attention model "
                "(yet; docs/scheduler-connectors.md)"
            )
        if self.kv_connector == "pd" and self.model not in ("full", "mamba-hybrid"):
            raise ValueError(
                "the P/D connector is driven only with the full-attention model and the Mamba hybrid (yet; "
                "docs/scheduler-connectors.md)"
            )
        if self.kv_events_full and not self.kv_events:
            raise ValueError("full KV cache event reports need the KV cache events (--kv-events)")
        if self.prefix_resets and self.kv_connector == "pd":
            raise ValueError(
                "prefix-cache resets are not driven with the P/D connector: vLLM refuses a reset that preempts while a "
                "request waits for a remote load (it raises: 'not supported yet'), and the remote producer's K/V would "
                "need new weights of its own (docs/scheduler-features.md)"
            )
        if self.sessions and (self.async_scheduling or self.speculative_tokens or self.kv_connector != "none"):
            raise ValueError(
                "resumable requests (sessions) are driven only with synchronous scheduling, no speculative decoding "
                "and no KV connector (yet): kvfuzz's client learns where a session paused from the outputs of the "
                "step it collected, which in-flight batches, drafts trimmed at a stop and deferred loads run ahead "
                "of (docs/scheduler-features.md)"
            )
        if not 0 <= self.max_loras <= MAX_LORAS:
            raise ValueError(f"max_loras must be 0 (no LoRA) .. {MAX_LORAS}, got {self.max_loras}")
        if not 0 < self.schedule_conservativeness <= MAX_SCHEDULE_CONSERVATIVENESS:
            raise ValueError(
                f"schedule_conservativeness must be in (0, {MAX_SCHEDULE_CONSERVATIVENESS:g}], got "
                f"{self.schedule_conservativeness:g}"
            )
        if self.prefix_match_unit:
            self._check_prefix_match_unit()
        if not 0 <= self.long_prefill_token_threshold <= self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold must be 0 (no cap) .. max_model_len {self.max_model_len}, as vLLM "
                f"checks, got {self.long_prefill_token_threshold}"
            )
        if self.long_prefill_token_threshold_adaptive and not self.long_prefill_token_threshold:
            raise ValueError(
                "long_prefill_token_threshold_adaptive floors a cap: it needs long_prefill_token_threshold"
            )
        if self.pauses and self.sessions:
            raise ValueError(
                "pauses are not driven with resumable requests (sessions) (yet): a paused session resumes through "
                "vLLM's queue of requests holding blocks, which the pause check does not model"
            )
        if not 1 <= self.prefill_schedule_interval <= MAX_PREFILL_SCHEDULE_INTERVAL:
            raise ValueError(
                f"prefill_schedule_interval must be 1 (every step) .. {MAX_PREFILL_SCHEDULE_INTERVAL}, got "
                f"{self.prefill_schedule_interval}"
            )
        if not 0 <= self.max_num_active_seqs <= self.max_num_seqs:
            raise ValueError(
                f"max_num_active_seqs must be 0 (unset) .. max_num_seqs {self.max_num_seqs}, as vLLM checks, got "
                f"{self.max_num_active_seqs}"
            )
        if not self.chunked_prefill:
            self._check_unchunked()
        if self.mamba_checkpoints:
            self._check_mamba_checkpoints()
        if self.max_model_len < 2:
            raise ValueError(f"a pool of {self.max_model_len} slot(s) holds no prompt with a generated token")

    def _check_mamba_checkpoints(self) -> None:
        """Prefill checkpoints where vLLM exports them (a Mamba hybrid's align mode: prefix caching on), and where
        kvfuzz's runner tells prefill rows from decode rows as vLLM's does (no drafts: a row of 1 + k tokens is a
        decode there, which kvfuzz does not model yet)."""
        if self.model != "mamba-hybrid" or not self.prefix_caching:
            raise ValueError(
                "mamba_checkpoints needs model mamba-hybrid with prefix caching: vLLM exports prefill checkpoints in "
                "its Mamba prefix caching (align mode) only"
            )
        if self.speculative_tokens:
            raise ValueError(
                "mamba_checkpoints is not driven with speculative decoding (yet): vLLM's Mamba2 runner takes a row of "
                "1 + k tokens as a decode, which exports no checkpoint, and kvfuzz's runner does not model that split"
            )

    def _check_unchunked(self) -> None:
        """Chunked prefill off where vLLM runs it: not with a Mamba hybrid's prefix caching (vLLM asserts chunked
        prefill there), and not with a long-prefill cap, which vLLM applies before it checks chunked prefill and so
        splits a prompt anyway (whether that is meant is vLLM's to say: docs/oracles.md)."""
        if self.model == "mamba-hybrid" and self.prefix_caching:
            raise ValueError(
                "chunked prefill off with model mamba-hybrid needs prefix caching off: vLLM asserts chunked prefill "
                "for Mamba prefix caching"
            )
        if self.long_prefill_token_threshold:
            raise ValueError(
                "chunked prefill off is not driven with long_prefill_token_threshold: vLLM caps a prompt at the "
                "threshold before it checks chunked prefill, so it splits prompts anyway (docs/oracles.md)"
            )

    def _check_prefix_match_unit(self) -> None:
        """A ``prefix_match_unit`` that turns vLLM's partial prefix-cache hits on: finer than the block, dividing it, on
        a Mamba hybrid with prefix caching (vLLM's ``partial_hash_hits_enabled``: a Mamba group in ``align`` mode whose
        block is larger than the hash block; on an attention-only model vLLM refuses any unit but the block size)."""
        if self.model != "mamba-hybrid" or not self.prefix_caching:
            raise ValueError(
                "prefix_match_unit (partial prefix-cache hits) needs model mamba-hybrid with prefix caching: vLLM "
                "turns partial hits on only for a Mamba group in align mode (docs/scheduler-features.md)"
            )
        if not 0 < self.prefix_match_unit < self.block_size or self.block_size % self.prefix_match_unit:
            raise ValueError(
                f"prefix_match_unit must divide block_size {self.block_size} and be smaller, got "
                f"{self.prefix_match_unit}"
            )

    @property
    def hash_block_size(self) -> int:
        """Tokens per prefix-cache hash (vLLM's ``hash_block_size``): ``prefix_match_unit``, or the block size."""
        return self.prefix_match_unit or self.block_size

    @property
    def max_model_len(self) -> int:
        """The longest request (prompt and output) the target is given: the whole pool, or for a hybrid model the
        longest whose blocks in every group fit the pool (:func:`~kvfuzz.scheduler.models.max_model_len`); with
        chunked prefill off, at most the token budget (vLLM refuses a longer one, whose prompt no step could hold); with
        prefill checkpoints, their Mamba blocks beside."""
        checkpoints = CHECKPOINT_BLOCKS if self.mamba_checkpoints else 0
        longest = max_model_len(
            MODELS[self.model], self.num_blocks, self.block_size, self.max_in_flight_tokens, checkpoints
        )
        return longest if self.chunked_prefill else min(longest, self.max_num_batched_tokens)

    @property
    def max_in_flight_tokens(self) -> int:
        """The most tokens scheduled and not yet returned, vLLM's ``VllmConfig.max_in_flight_tokens``: the token
        budget of every batch in flight at once (two under async scheduling; a sliding window's admission cap
        reserves blocks for them)."""
        return self.max_num_batched_tokens * (DEPTH if self.async_scheduling else 1)

    def describe(self) -> str:
        return (
            f"{self.num_blocks} blocks x {self.block_size} slots, token budget {self.max_num_batched_tokens}, "
            f"at most {self.max_num_seqs} running, prefix caching {'on' if self.prefix_caching else 'off'}"
            + (f", {self.policy} scheduling" if self.policy != "fcfs" else "")
            + (f", model {self.model}: {MODELS[self.model].description}" if self.model != "full" else "")
            + (f", {self.speculative_tokens} speculative draft(s)" if self.speculative_tokens else "")
            + (f" ({self.drafter} drafter)" if self.drafter != "ngram" else "")
            + (", async scheduling" if self.async_scheduling else "")
            + (", cache salts" if self.cache_salts else "")
            + (", stop tokens" if self.stop_tokens else "")
            + (", EOS" if self.eos else "")
            + (", min_tokens" if self.min_tokens else "")
            + (f", {self.kv_connector} connector" if self.kv_connector != "none" else "")
            + (f" (transfers up to {self.transfer_delay} step(s) late)" if self.transfer_delay else "")
            + (" (loads may fail)" if self.load_failures else "")
            + (" (a failed load fails its request)" if self.load_failure_policy == "fail" else "")
            + (", requests skipping prefix-cache reads" if self.skip_prefix_reads else "")
            + (f", {self.retention} prefix-cache retention" if self.retention != "semantic" else "")
            + (f", LoRA (at most {self.max_loras} adapter(s) a step)" if self.max_loras else "")
            + (", prefix-cache resets" if self.prefix_resets else "")
            + (", KV cache events" if self.kv_events else "")
            + (" (full reports for half the requests)" if self.kv_events_full else "")
            + (", requests past max_model_len" if self.overlong_requests else "")
            + (", scheduler stats" if self.stats else "")
            + (f", prefix hashes every {self.prefix_match_unit} token(s)" if self.prefix_match_unit else "")
            + (", resumable requests (sessions)" if self.sessions else "")
            + (
                f", at most {self.long_prefill_token_threshold} token(s) a request and step beside others"
                + (" (floored at a fair share of the budget)" if self.long_prefill_token_threshold_adaptive else "")
                if self.long_prefill_token_threshold
                else ""
            )
            + (f", at most {self.max_num_active_seqs} admitted to run" if self.max_num_active_seqs else "")
            + (", pauses" if self.pauses else "")
            + (", chunked prefill off" if not self.chunked_prefill else "")
            + (
                f", prefill every {self.prefill_schedule_interval} executed steps while a decode runs"
                if self.prefill_schedule_interval > 1
                else ""
            )
            + (
                f", schedule conservativeness {self.schedule_conservativeness:g}"
                if self.schedule_conservativeness != 1.0
                else ""
            )
        )
