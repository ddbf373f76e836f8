"""kvfuzz as vLLM's model runner: worker-side block tables kept from each ``SchedulerOutput`` as the model runner
the configuration selects keeps them, the K/V of every scheduled token written into the slot those tables give,
the content every scheduled token attends to checked, and a ``ModelRunnerOutput`` of the fake model's tokens.

vLLM 0.33.0 has two model runners, and the scheduler speaks to each its own way (``use_v2_model_runner``, the
default where Triton is installed, as in kvfuzz's vLLM environment; 0.34.0 has V2 alone: what differs between
releases is read through :mod:`kvfuzz.scheduler.vllm_release`):

* the V1 runner (``GPUModelRunner._update_states``) keeps a preempted request's state: the scheduler resumes it among
  the cached requests (``resumed_req_ids``), with a new table that replaces the old;
* the V2 runner (``gpu/model_runner.py``) drops a preempted request as a finished one (``preempted_req_ids``), and the
  scheduler resumes it as a new request whose ``prefill_token_ids`` are all its tokens, outputs included.

Invariants the worker holds vLLM to:

* **content**: after a step's writes, every position ``0 .. c + n - 1`` of a request scheduled for positions
  ``c .. c + n - 1`` holds the K/V of that request's own tokens up to it (kvfuzz's tag-based K/V of
  :mod:`kvfuzz.reference.content`, under the request's cache salt as namespace), whether this step wrote it, an
  earlier step did, or another request did and the
  prefix cache handed the block over;
* **exclusive writes**: no scheduled token's K/V is written over a slot whose content a live request (one the worker
  holds, not preempted) relies on, a position it has computed, nor over a slot another write of the same step
  took (unless the content is the same);
* every scheduled position is one whose token the worker knows, or a draft scheduled for it (speculative decoding,
  :mod:`kvfuzz.scheduler.speculative`, which also checks the drafts and their rollback; under async scheduling the
  worker's own drafts in place of the scheduler's placeholders, at positions from its own count), and falls inside
  the request's table;
* the scheduler counts as many outputs for a request it schedules again as the fake model sampled for it, and a
  request resumed as new carries exactly its prompt and those outputs. (Under async scheduling the scheduler's count
  includes its output placeholders, the tokens of steps still in flight: the worker has sampled those already, since
  it runs a step when the engine core launches it, as the GPU runs it; :mod:`kvfuzz.scheduler.async_batches`.)
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from kvfuzz.scheduler.attention import Attending, AttentionCheck, NoAttention
from kvfuzz.scheduler.batch import check_batch, check_table_covers
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.eagle import Admitted, DraftKV
from kvfuzz.scheduler.fake_model import UNMASKED, MinTokens
from kvfuzz.scheduler.groups import group_namespace, group_rules, mamba_groups
from kvfuzz.scheduler.kv_slots import Claims, SlotPool
from kvfuzz.scheduler.lora import check_loras, lora_id
from kvfuzz.scheduler.mamba_checkpoints import checkpoint_rule
from kvfuzz.scheduler.mamba_states import mamba_states
from kvfuzz.scheduler.partial_prefix import copy_blocks, hit_check
from kvfuzz.scheduler.prefix_reads import ReadSkips
from kvfuzz.scheduler.speculative import Verified, speculation_for
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_build import cache_hit_alignment_tokens, kv_cache_config, vllm_config
from kvfuzz.scheduler.vllm_release import vllm_release
from kvfuzz.scheduler.write_paths import OwnSlotMapping, WritePathFactory


def min_tokens_of(sampling_params: Any) -> MinTokens:
    """The min-tokens processor vLLM's model runner builds from a new request's sampling params: its
    ``min_tokens`` and ``all_stop_token_ids`` (none without sampling params)."""
    if sampling_params is None or not sampling_params.min_tokens:
        return UNMASKED
    return MinTokens(sampling_params.min_tokens, sampling_params.all_stop_token_ids)


@attrs.define
class RequestState:
    """What the worker keeps of one request, as the model runner's ``CachedRequestState``."""

    tokens: list[int]  # the prompt, then every token the fake model sampled for it
    prompt_length: int  # how many of ``tokens`` are the prompt
    tables: list[list[int]]  # per KV-cache group, vLLM block ids in position order
    computed: int = 0  # positions whose K/V the request relies on (computed, or found in the prefix cache)
    preempted: bool = False  # preempted and not resumed since: ``tables`` are stale
    namespace: tuple[str, ...] = ()  # its K/V tags' namespace: its cache salt, if any (kvfuzz.scheduler.requests)
    hit: int = 0  # positions it was given from the prefix cache when scheduled new or resumed (it never wrote them)
    sampler: MinTokens = UNMASKED  # the sampler's min-tokens processor, from the sampling params the output brought
    lora: int = 0  # the LoRA adapter's id the output brought (0: none), as the model runner's input batch keeps it

    @property
    def table(self) -> list[int]:
        """Group 0's table: the only one of a one-group model."""
        return self.tables[0]


class Worker:
    """The worker side of one example. Subclasses in the engine tests seed bugs by overriding :meth:`slots` (kvfuzz's
    own slot mapping), :meth:`sampled` (the model's output) or :meth:`verified_tokens` (the output of a step with
    drafts).

    ``write_path`` decides where each scheduled token's K/V is written (:mod:`kvfuzz.scheduler.write_paths`: kvfuzz's
    own :meth:`slots`, or vLLM's worker-side block tables, checked against :meth:`slots`); ``attention`` computes
    the step's attention through the tables beside the reference (:mod:`kvfuzz.scheduler.attention`)."""

    def __init__(
        self,
        setup: SchedulerSetup,
        write_path: WritePathFactory = OwnSlotMapping,
        attention: Optional[AttentionCheck] = None,
    ) -> None:
        self.block_size = setup.block_size  # slots per block
        self.groups = group_rules(kv_cache_config(setup))  # the attention groups, in vLLM's order
        self.rules = {rule.index: rule for rule in self.groups}  # attention group index -> its rule
        # the Mamba groups' state blocks, prefix-cache hits landing every hash block (and their prefill checkpoints
        # where the Mamba layers export them: mamba_checkpoints.py)
        groups, mode, mamba_block = mamba_groups(kv_cache_config(setup))
        checkpoints = setup.mamba_checkpoints  # only a Mamba hybrid's (the configuration refuses the rest)
        checkpoint = checkpoint_rule(setup, mamba_block, cache_hit_alignment_tokens(setup)) if checkpoints else None
        self.mamba = mamba_states(groups, mode, mamba_block, setup.hash_block_size, checkpoint)
        self.copies = 0  # block copies run (copy-on-write of partial prefix-cache hits: partial_prefix.py)
        self.prefix_hits = hit_check(setup)  # hits end on the prefix hashes (partial_prefix.py)
        self.read_skips = ReadSkips(setup)  # a request that skips prefix-cache reads gets no hit (prefix_reads.py)
        self.num_groups = len(self.groups) + len(self.mamba.groups)
        # one pool for every group (vLLM's hybrid allocator gives them one block pool); vLLM's null block 0 too
        self.kv = SlotPool((setup.num_blocks + 1) * setup.block_size, setup.block_size)
        self.release = vllm_release()  # what differs between vLLM releases, read its way
        self.runner_v2 = self.release.runner_v2(vllm_config(setup))  # which model runner's protocol is spoken
        self.requests: dict[str, RequestState] = {}  # every request the worker holds, as the model runner's
        self.history: dict[str, list[int]] = {}  # unfinished request -> every token the fake model sampled for it
        self.computed: dict[str, int] = {}  # request scheduled this step -> its computed tokens before the step
        self.namespaces: dict[str, tuple[str, ...]] = {}  # request -> its K/V namespace, told by the client's side
        self.asked_loras: dict[str, int] = {}  # request -> the LoRA adapter its client asked for (0: none)
        # streaming session -> the tokens each of its next turns is to be scheduled anew with, told by the client
        self.session_inputs: dict[str, list[list[int]]] = {}
        self.max_loras = setup.max_loras  # the most distinct adapters a step may schedule (0: no LoRA)
        # the drafts proposed, scheduled and verified (under async, kept by the worker as the V2 runner keeps them)
        self.speculation = speculation_for(setup.speculative_tokens, setup.async_scheduling)
        self.drafts: Optional[tuple[list[str], list[list[int]]]] = None  # proposed after the last step, untaken
        self.write_path = write_path(setup, self.runner_v2, self)  # decides the slots K/V is written to
        self.attention = NoAttention() if attention is None else attention  # attention beside the reference
        # an EAGLE head's draft K/V, and the hits admitted onto it (eagle.py); None: a drafter without draft K/V
        self.eagle = DraftKV(self.kv.tags, self.kv.drafts) if setup.drafter.startswith("eagle") else None

    # -- the scheduler's output, as the model runner reads it ------------------------------------------------------

    def consume(self, output: Any, step: int) -> None:
        """Update the tables from ``output``: finished requests dropped, preempted ones marked stale, new ones added
        with their block ids, cached ones extended by their new block ids or, resumed, given their new table. The
        batch is checked first (:func:`~kvfuzz.scheduler.batch.check_batch`)."""
        check_batch(output, self.live_tables(), step)
        for request in output.finished_req_ids:
            self.requests.pop(request, None)
            self.history.pop(request, None)
            self.namespaces.pop(request, None)
            self.asked_loras.pop(request, None)
            self.session_inputs.pop(request, None)
            self.speculation.forget(request)
        for request in output.preempted_req_ids or ():
            self.speculation.forget(request)  # the scheduler drops a preempted request's drafts
            if self.runner_v2:
                self.requests.pop(request, None)
            elif request in self.requests:
                self.requests[request].preempted = True
        # the runner copies blocks (partial prefix-cache hits) before it adds the step's requests
        copies = output.kv_cache_block_copies or ()
        if copies:
            self.copies += copy_blocks(copies, self.kv, self.mamba, self.holdings()[0], step)
        self.computed = {}
        for new in output.scheduled_new_reqs:
            if new.req_id in self.requests:  # only a streaming session is scheduled anew while the worker holds it
                self._resume_session(new, step)
                continue
            prompt = list(new.prompt_token_ids)
            tokens = prompt if new.prefill_token_ids is None else list(new.prefill_token_ids)
            sampled = self.history.setdefault(new.req_id, [])
            if tokens != prompt + sampled:
                raise SchedulerViolation(
                    Check.OUTPUTS,
                    step,
                    new.req_id,
                    f"scheduled as new with tokens {tokens}, but its prompt is {prompt} and the fake model sampled "
                    f"{sampled} for it",
                    "a request scheduled anew with other tokens",
                )
            self.requests[new.req_id] = RequestState(
                tokens,
                len(prompt),
                [list(ids) for ids in new.block_ids],
                computed=new.num_computed_tokens,
                namespace=self.namespaces.get(new.req_id, ()),
                hit=new.num_computed_tokens,
                sampler=min_tokens_of(new.sampling_params),
                lora=lora_id(new.lora_request),
            )
            self.prefix_hits.check(new.req_id, new.num_computed_tokens, len(tokens), step)
            self.read_skips.check(new.req_id, new.num_computed_tokens, step)
            self._admit_drafts(new.req_id, step)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = output.scheduled_cached_reqs
        resumed = self.release.resumed(cached)
        for index, request in enumerate(cached.req_ids):
            state = self.requests[request]
            blocks = cached.new_block_ids[index]
            if request in resumed:
                state.tables = [list(ids) for ids in blocks]
                state.preempted = False
                state.hit = cached.num_computed_tokens[index]
                self.prefix_hits.check(request, state.hit, len(state.tokens), step)
                self.read_skips.check(request, state.hit, step)
                self._admit_drafts(request, step)
            elif blocks is not None:
                for table, ids in zip(state.tables, blocks):
                    table.extend(ids)
            computed = cached.num_computed_tokens[index]
            if request not in resumed:  # first: a count of drafts not rolled back is named as such
                computed = self.speculation.position(request, computed, state.computed, step)
            outputs = len(state.tokens) - state.prompt_length
            optimistic = self.speculation.in_flight(request)  # rejected drafts counted until their step returns
            if cached.num_output_tokens[index] != outputs + optimistic:
                raise SchedulerViolation(
                    Check.OUTPUTS,
                    step,
                    request,
                    f"the scheduler counts {cached.num_output_tokens[index]} output tokens, but the fake model "
                    f"sampled {outputs}"
                    + (f" and steps in flight rejected {optimistic} draft(s) it still counts" if optimistic else ""),
                    "the scheduler's count of output tokens",
                )
            self.computed[request] = state.computed = computed
        adapters = {request: self.requests[request].lora for request in output.num_scheduled_tokens}
        check_loras(output.num_scheduled_tokens, adapters, self.asked_loras, self.max_loras, step)
        known = {request: len(self.requests[request].tokens) for request in output.num_scheduled_tokens}
        self.speculation.schedule(output, known, step)
        self.write_path.consume(output)

    def _resume_session(self, new: Any, step: int) -> None:
        """A streaming session scheduled anew for its next turn, as the model runner's ``_update_streaming_request``
        takes it: its prompt must be the tokens its client expects (the kept tokens and the new input: the earlier
        turn's last output dropped), with a new input sent since it paused; its table is replaced, its outputs start
        over. Its computed K/V stays: the content check holds the turn to attending exactly its own earlier K/V."""
        request = new.req_id
        inputs = self.session_inputs.get(request)
        if not inputs:
            raise SchedulerViolation(
                Check.SESSIONS,
                step,
                request,
                f"scheduled anew ({new.num_computed_tokens} computed) while the model runner still holds it, but it "
                "is a session paused at its stop and its client has sent no new input since: only a session's next "
                "turn is scheduled anew",
                "a paused session scheduled",
            )
        expected = inputs.pop(0)
        prompt = list(new.prompt_token_ids)
        tokens = prompt if new.prefill_token_ids is None else list(new.prefill_token_ids)
        if prompt != expected or tokens != expected:
            raise SchedulerViolation(
                Check.SESSIONS,
                step,
                request,
                f"the session's next turn is scheduled with tokens {tokens}, but it kept {expected} (its earlier "
                "turns' tokens, the last sampled one dropped, then its new input)",
                "a session resumed with other tokens",
            )
        state = self.requests[request]
        state.tokens = expected
        state.prompt_length = len(expected)
        state.tables = [list(ids) for ids in new.block_ids]
        state.sampler = min_tokens_of(new.sampling_params)
        state.lora = lora_id(new.lora_request)
        self.history[request] = []
        self.speculation.forget(request)
        self.computed[request] = state.computed = new.num_computed_tokens

    def live_tables(self) -> dict[str, list[list[int]]]:
        """The tables (one per group) of every request the worker holds that is not preempted: the blocks it may
        read and write."""
        return {request: state.tables for request, state in self.requests.items() if not state.preempted}

    def attention_holdings(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """:meth:`holdings` of the attention groups alone."""
        held: dict[str, list[int]] = {}
        maybe: dict[str, list[int]] = {}
        for request, state in self.requests.items():
            if state.preempted:
                continue
            for rule in self.groups:
                table = state.tables[rule.index]
                released = rule.released_entries(state.computed, state.prompt_length, self.block_size)
                must, may = held.setdefault(request, []), maybe.setdefault(request, [])
                must.extend(block for block in table[: released.start] if block != 0)
                must.extend(block for block in table[released.stop :] if block != 0)
                may.extend(block for block in table[released.start : released.stop] if block != 0)
        return held, maybe

    def holdings(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """The blocks of the live tables across groups: those each request must hold (every entry a group still
        needs), and those it may hold or may have released (a sliding-window group's entries wholly before its
        window); vLLM's null block in neither."""
        held, maybe = self.attention_holdings()
        for request, state in self.requests.items():
            if state.preempted:
                continue
            for group in self.mamba.groups:  # the running state's block and those after it are held
                must, may = self.mamba.held_entries(state.tables[group], state.computed)
                held.setdefault(request, []).extend(must)
                maybe.setdefault(request, []).extend(may)
        return held, maybe

    def _in(self, group: int) -> str:
        """`` in group N (its kind)`` where the model has several groups, for messages; nothing otherwise."""
        return "" if self.num_groups == 1 else f" in {self.rules[group].describe()}"

    # -- the step ----------------------------------------------------------------------------------------------

    def slots(self, request: str, positions: range, step: int, group: Optional[int] = None) -> list[int]:
        """The slots the K/V of a request's tokens at ``positions`` are written to in ``group`` (by default the
        first attention group, the one the write path maps): the slot mapping the model runner computes from that
        group's table."""
        return self._slots(request, positions, step, self.groups[0].index if group is None else group)

    def sampled(self, request: str, position: int) -> list[int]:
        """The tokens the fake model returns for a request whose sequence has ``position`` tokens: its one sample,
        under the min-tokens processor its sampling params (as the scheduler's output brought them) ask for."""
        state = self.requests[request]
        return [state.sampler.token(request, state.prompt_length, position)]

    def verified_tokens(self, request: str, known: int, verified: Verified) -> list[int]:
        """The tokens returned for a request with ``known`` tokens whose drafts ``verified`` judged: the accepted
        drafts (the fake model's own tokens), then the fake model's sample after them."""
        return list(verified.drafts[: verified.accepted]) + self.sampled(request, known + verified.accepted)

    def take_draft_token_ids(self) -> Optional[tuple[list[str], list[list[int]]]]:
        """The drafts proposed after the last step (request ids, and each one's drafts), once, as vLLM's model
        runner gives them to the engine core; None when speculative decoding proposed nothing."""
        drafts, self.drafts = self.drafts, None
        return drafts

    def execute(self, output: Any, step: int) -> tuple[list[str], list[list[int]]]:
        """Write the K/V of every scheduled token, check what each scheduled request attends to, and sample: the
        request ids in order, and each one's sampled tokens (none for a prefill chunk that ends before the last
        token)."""
        scheduled = output.num_scheduled_tokens
        for request, count in scheduled.items():
            for rule in self.groups:
                table = self.requests[request].tables[rule.index]
                check_table_covers(request, table, self.computed[request], count, self.block_size, step)
        taken = self._relied_on(step)
        batch = [
            (request, range(self.computed[request], self.computed[request] + count))
            for request, count in scheduled.items()
        ]
        for request, positions in batch:
            self._check_known(request, positions, step)
        for (request, positions), slots in zip(batch, self.write_path.slot_mapping(batch, step)):
            self._write(request, positions, slots, step, taken)
        attending = self.attention.views(  # each scheduled request's view in each group, as the step wrote it
            lambda: [
                Attending(
                    request,
                    tuple(self._tokens(request)),  # with the drafts scheduled this step
                    tuple(self.requests[request].tables[rule.index]),
                    positions,
                    self._namespace(request, rule.index),
                    rule,
                    self._in(rule.index),
                )
                for request, positions in batch
                for rule in self.groups
            ]
        )
        held = self.holdings()[0] if self.mamba.groups else {}  # the blocks live requests still need, for Mamba
        order: list[str] = []
        sampled: list[list[int]] = []
        lengths: dict[str, int] = {}  # request that sampled -> its sequence's length after the step
        for request, count in scheduled.items():
            state = self.requests[request]
            end = self.computed[request] + count
            for rule in self.groups:
                self._check_content(request, end, step, rule.index)
            span = range(self.computed[request], end)
            self.mamba.step(request, state.tables, self._tokens(request), span, state.namespace, step, held)
            known = len(state.tokens)
            order.append(request)
            if end < known:  # a prefill chunk that stops short samples nothing
                state.computed = end
                sampled.append([])
                continue
            verified = self.speculation.verify(request, known, end, step)
            state.computed = verified.computed  # rejected drafts' positions are stale: nothing relies on them
            tokens = self.verified_tokens(request, known, verified)
            state.tokens.extend(tokens)
            self.history[request].extend(tokens)
            sampled.append(tokens)
            lengths[request] = len(state.tokens)
        if self.eagle is not None:  # the head's K/V, once each request's next token is known, then the hits on it
            for request in order:
                state = self.requests[request]
                self._write_drafts(request, range(self.computed[request], state.computed), step)
            self.eagle.check_admitted(step)
        self.attention.check(attending, self.kv, step)  # after content: it names the slot at fault
        self.drafts = self.speculation.propose(output, lengths)
        return order, sampled

    def _admit_drafts(self, request: str, step: int) -> None:
        """With an EAGLE head: ``request``, scheduled with its prefix-cache hit, has the hit's draft K/V checked once
        the step wrote its own (:meth:`~kvfuzz.scheduler.eagle.DraftKV.check_admitted`)."""
        if self.eagle is None:
            return
        state = self.requests[request]
        for rule in self.groups:
            start = rule.first_needed(state.hit)
            slots = self._slots(request, range(start, state.hit), step, rule.index)
            namespace = self._namespace(request, rule.index)
            self.eagle.admit(Admitted(request, state.hit, slots, start, list(state.tokens), namespace))

    def _write_drafts(self, request: str, positions: range, step: int) -> None:
        """The EAGLE head's K/V of ``request`` at ``positions``, computed this step, in every attention group."""
        assert self.eagle is not None
        tokens = self.requests[request].tokens
        for rule in self.groups:
            slots = self._slots(request, positions, step, rule.index)
            self.eagle.write(request, tokens, positions, slots, self._namespace(request, rule.index), step)

    def _tokens(self, request: str) -> list[int]:
        """A request's known tokens, then the drafts scheduled for it this step: what its scheduled positions hold."""
        return self.requests[request].tokens + self.speculation.drafts(request)

    def _namespace(self, request: str, group: int) -> tuple[str, ...]:
        """The namespace of a request's K/V tags in ``group``: the group's, then the request's cache salt's."""
        return group_namespace(group) + self.requests[request].namespace

    def _slots(self, request: str, positions: range, step: int, group: int) -> list[int]:
        """The slot of each of ``positions`` (consecutive) in ``group``."""
        table = self._table(request, positions, step, group)
        size = self.block_size
        return [table[position // size] * size + position % size for position in positions]

    def _table(self, request: str, positions: range, step: int, group: int) -> list[int]:
        """``request``'s table in ``group``, once every entry ``positions`` (consecutive) fall in is checked to be
        one it has and a real block (:meth:`_slot` names the first position at fault)."""
        table = self.requests[request].tables[group]
        if positions:
            last = (positions.stop - 1) // self.block_size
            if last >= len(table) or 0 in table[positions.start // self.block_size : last + 1]:
                for position in positions:
                    self._slot(request, position, step, group)
        return table

    def _slot(self, request: str, position: int, step: int, group: int = 0) -> int:
        table = self.requests[request].tables[group]
        entry = position // self.block_size
        if entry >= len(table):
            raise SchedulerViolation(
                Check.CONTENT,
                step,
                request,
                f"position {position} falls in table entry {entry}, but the request's table{self._in(group)} has "
                f"only {len(table)} block(s): {table}",
                "a position beyond the request's table",
            )
        if table[entry] == 0:
            raise SchedulerViolation(
                Check.CONTENT,
                step,
                request,
                f"position {position} maps to vLLM's null block 0{self._in(group)} (table {table})"
                + ("" if self.rules[group].reads_all else ", but the request still attends it"),
                "a position mapped to the null block",
            )
        return table[entry] * self.block_size + position % self.block_size

    def _relied_on(self, step: int) -> Claims:
        """The claims of the live requests that have computed a position and rely on its content, through their
        tables (when several do, as blocks the prefix cache shares, the first: they need the same content, or the
        content check fails one of them)."""
        relied = self.kv.claims()
        for request, state in self.requests.items():
            if state.preempted or not state.computed:
                continue
            for rule in self.groups:
                namespace = self._namespace(request, rule.index)
                for run in rule.attended(state.computed, state.computed, state.prompt_length):
                    table = self._table(request, run, step, rule.index)
                    relied.rely(request, state.tokens[: run.stop], table, run.start, namespace)
        return relied

    def _check_known(self, request: str, positions: range, step: int) -> None:
        """Every scheduled position is one whose token the worker knows, or a draft scheduled for it."""
        tokens = self._tokens(request)
        known = len(self.requests[request].tokens)
        if positions.stop > len(tokens):
            drafted = len(tokens) - known
            raise SchedulerViolation(
                Check.CONTENT,
                step,
                request,
                f"positions {positions.start}..{positions.stop - 1} scheduled, but the request has only "
                f"{known} tokens" + (f" and {drafted} draft(s)" if drafted else ""),
                "positions scheduled past the request's tokens",
            )

    def _check_mapping(self, request: str, positions: range, slots: list[int], step: int, group: int) -> None:
        """The write path's slots in ``group`` are the ones the worker's table of that group gives (for kvfuzz's own
        path, trivially)."""
        expected = self.slots(request, positions, step, group)
        for position, want, got in zip(positions, expected, slots):
            if want != got:
                table = self.requests[request].tables[group]
                raise SchedulerViolation(
                    Check.SLOT_MAPPING,
                    step,
                    request,
                    f"its position {position} belongs in block {want // self.block_size} (table entry "
                    f"{position // self.block_size} of {table}{self._in(group)}), slot {want}, but the "
                    f"{self.write_path.name} slot "
                    f"mapping writes it to slot {got} (block {got // self.block_size}, offset "
                    f"{got % self.block_size})",
                    "a token written to another slot than its table gives"
                    if got // self.block_size == want // self.block_size
                    else "a token written to another block than its table gives",
                )
        if len(slots) != len(expected):
            raise SchedulerViolation(
                Check.SLOT_MAPPING,
                step,
                request,
                f"{len(positions)} positions scheduled, but the {self.write_path.name} slot mapping gives "
                f"{len(slots)} slots{self._in(group)}",
                "a slot mapping of the wrong length",
            )

    def _write(self, request: str, positions: range, slots: list[list[int]], step: int, taken: Claims) -> None:
        """Write the K/V of a request's tokens at ``positions`` into ``slots`` (one list per KV-cache group), once
        each group's are checked against its table. A write that gives a slot in ``taken`` content other than its
        claim needs breaks exclusivity; ``taken`` gets a claim for every slot written. (A request admitted in the
        same step as the one that writes its prefix relies on that step's write: vLLM caches full blocks when they
        are scheduled, and the step writes every token's K/V before attention reads it.)"""
        if not positions:
            return
        state = self.requests[request]
        known = len(state.tokens)  # positions from here on hold drafts
        for rule, group_slots in zip(self.groups, slots):
            group = rule.index
            self._check_mapping(request, positions, group_slots, step, group)
            namespace = self._namespace(request, group)
            self.kv.write(request, self._tokens(request), positions, group_slots, step, taken, namespace, known)

    def _check_content(self, request: str, end: int, step: int, group: int = 0) -> None:
        """Every position before ``end`` that the step's tokens attend to in ``group`` (all of them for full
        attention; those within the window of the first scheduled token on, for a sliding window, and the prompt
        too for R-SWA) holds the K/V of the request's own prefix up to it (drafts included)."""
        state, tokens = self.requests[request], self._tokens(request)
        namespace = self._namespace(request, group)
        for run in self.rules[group].attended(self.computed[request], end, state.prompt_length):
            slots = self._slots(request, run, step, group)
            self.kv.check(request, tokens[: run.stop], slots, step, namespace, run.start, state.hit)
