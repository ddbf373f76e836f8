"""One example against vLLM's real scheduler: requests added and aborted as a client would, and steps run as
vLLM's engine core runs them (``schedule()``, the worker, ``update_from_output()``), every check after each.

A step is launched (:meth:`Session.launch`): ``schedule()``; the worker reads the output (finished, preempted, new
and cached requests); the accounting check; under async scheduling the released-block check; the worker writes the
scheduled tokens' K/V and checks what they attend to (content). It is collected (:meth:`Session.collect`):
``update_from_output()`` with the fake model's tokens; the output check. Synchronous scheduling collects each step
right after launching it; async scheduling keeps up to two in flight (:mod:`kvfuzz.scheduler.async_batches`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

from kvfuzz.program.safeguards import Journal, Watchdog
from kvfuzz.scheduler.accounting import check_accounting
from kvfuzz.scheduler.async_batches import DEPTH, Batch, BatchQueue, Progress, SynchronousLoop
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.disaggregation import PDWorker
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.kv_events import KnownRequest, event_checker, full_reports
from kvfuzz.scheduler.lora import limit_held_back
from kvfuzz.scheduler.model_length import capped_max_tokens
from kvfuzz.scheduler.offloading import NoConnector, OffloadingWorker, TransferTally, connector_for
from kvfuzz.scheduler.oracles import Arrival, PolicyOracles, step_events
from kvfuzz.scheduler.outputs import OutputLedger
from kvfuzz.scheduler.pausing import Paused, Pausing
from kvfuzz.scheduler.prefix_reads import skips_reads
from kvfuzz.scheduler.prefix_reset import PrefixResets
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, Pause, ResetPrefixCache, Resume, Step, Unpause
from kvfuzz.scheduler.requests import request_namespace
from kvfuzz.scheduler.sessions import SessionBook, Started, turn_ending
from kvfuzz.scheduler.snapshot import NO_OBSERVER, RequestAtStep, StepObserver, StepSnapshot
from kvfuzz.scheduler.stats import stats_checker
from kvfuzz.scheduler.step_watchdog import bounded_step
from kvfuzz.scheduler.stuck import stuck_cause
from kvfuzz.scheduler.trace import journal_configuration
from kvfuzz.scheduler.violations import Check, SchedulerViolation
from kvfuzz.scheduler.vllm_build import hash_lookahead, new_request, new_scheduler, vllm, vllm_config
from kvfuzz.scheduler.worker import Worker

WorkerFactory = Callable[[SchedulerSetup], Worker]
"""Builds the worker of an example (the engine tests pass subclasses that seed bugs)."""

EngineLoop = Union[SynchronousLoop, BatchQueue]
"""How the engine core runs steps: one at a time, or with batches in flight (async scheduling)."""


def drain_bound(remaining_tokens: int) -> int:
    """The steps a drain may take: each step computes at least one token of some request unless it is stuck, and a
    preemption recomputes what it dropped, so four times the requests' tokens, and a margin, is generous."""
    return 4 * remaining_tokens + 16


class Session:
    """A fresh ``Scheduler``, its worker and the output ledger; ``steps`` counts ``schedule()`` calls."""

    def __init__(
        self,
        setup: SchedulerSetup,
        worker: WorkerFactory = Worker,
        watchdog: Optional[Watchdog] = None,
        journal: Optional[Journal] = None,
    ) -> None:
        self.setup = setup  # the configuration
        self.watchdog = watchdog  # interrupts a step that runs past its limit (None: no limit); entered by the caller
        self.journal = journal  # keeps the program on disk, each operation before it runs (None: only in memory)
        self.scheduler = new_scheduler(setup)  # vLLM's v1 Scheduler, with its real KVCacheManager
        self.worker = worker(setup)  # kvfuzz as the model runner
        self.outputs = OutputLedger()  # every request's output so far
        self.steps = 0  # schedule() calls so far
        self.lengths: dict[str, int] = {}  # request -> prompt length + max_tokens
        self.preemptions = 0  # requests the scheduler preempted
        self.hit_tokens = 0  # tokens new and resumed requests found computed (prefix-cache hits)
        self.held_back = 0  # LoRA: steps after which the adapter limit held a waiting request back
        self.program: list[Operation] = []  # the client's operations so far, each recorded before it runs
        self.loop: EngineLoop = BatchQueue() if setup.async_scheduling else SynchronousLoop()  # the engine core
        self.connector = _connector(setup, self.scheduler, self.loop)  # the KV connector's worker side
        self.observer: StepObserver = NO_OBSERVER  # told of each step as soon as it is scheduled (kvfuzz show)
        self.resets = PrefixResets()  # the client's prefix-cache resets, and the K/V namespace's epoch
        self.hash_lookahead = hash_lookahead(setup)  # tokens after a block its hash covers (an EAGLE head's)
        self.events = event_checker(setup, self.scheduler)  # the KV cache events, checked against the pool
        self.stats = stats_checker(setup)  # the scheduler stats, checked against the pool and the requests
        self.pausing = Pausing()  # the client's pause of the scheduler, checked each step
        self.oracles = PolicyOracles(setup, vllm_config(setup), self.scheduler, self._known_tokens, self.pausing)
        self.sessions = SessionBook(setup.max_model_len, setup.hash_block_size)  # the client's streaming sessions
        if journal is not None:
            journal.begin_example(journal_configuration(setup, "V2" if self.worker.runner_v2 else "V1"))

    @property
    def engine(self) -> str:
        """What a harness error names as driven: vLLM and its installed version (read when asked: once a session,
        a package's metadata cost an example a millisecond and a half)."""
        return f"vLLM {installed_version('vllm')}"

    def add(
        self,
        prompt: list[int],
        max_tokens: int,
        priority: int = 0,
        cache_salt: Optional[str] = None,
        stop_token_ids: tuple[int, ...] = (),
        eos: bool = False,
        min_tokens: int = 0,
        lora: int = 0,
        resumable: bool = False,
    ) -> str:
        """Add a request (ids ``r0``, ``r1``, ... in arrival order) of ``priority`` (smaller runs first under the
        priority policy; FCFS ignores it), under ``cache_salt``, stopping at the first sampled token among
        ``stop_token_ids`` or, with ``eos``, at the model's end-of-sequence token, but not before ``min_tokens``
        outputs (kvfuzz's sampler masks its stop tokens until then), under LoRA adapter ``lora`` (0: none); returns
        its id. The worker is told the request's namespace (vLLM's model runner is not told the salt; kvfuzz's K/V
        depends on it and on the adapter so that the content check sees a hit across salts or adapters) and the
        adapter its client asked for (the LoRA check compares it with the one the scheduler's output brings).
        ``resumable``: a streaming session, continued by :meth:`resume` (:mod:`kvfuzz.scheduler.sessions`)."""
        arrival = len(self.lengths)
        request = f"r{arrival}"
        stops = tuple(stop_token_ids)
        self._perform(AddRequest(prompt, max_tokens, priority, cache_salt, stops, eos, min_tokens, lora, resumable))
        self.worker.namespaces[request] = self.resets.namespace(request, request_namespace(cache_salt, lora))
        self.worker.asked_loras[request] = lora
        ending = Ending(stops, eos, min_tokens)
        size = self.setup.hash_block_size  # the prefix-cache hash's tokens
        full = full_reports(self.setup, request)
        skips = skips_reads(self.setup, request)
        self.scheduler.add_request(
            new_request(
                request,
                prompt,
                max_tokens,
                size,
                arrival,
                priority,
                cache_salt,
                ending,
                lora,
                resumable,
                full,
                skips,
                self.hash_lookahead,
            )
        )
        self.oracles.added(Arrival(request, arrival, priority, lora, len(prompt)))
        capped = capped_max_tokens(self.setup, len(prompt), max_tokens)  # it stops at max_model_len
        self.outputs.added(request, len(prompt), capped, ending)
        self.lengths[request] = len(prompt) + capped
        if resumable:
            self.sessions.opened(request, prompt, ending, cache_salt, lora, priority)
        return request

    def resume(self, request: str, prompt: list[int], max_tokens: int) -> bool:
        """Continue streaming session ``request`` with new input ``prompt``, asking for ``max_tokens`` more outputs,
        as a client does (a request of the same id, resumable, added again); the input cut and ``max_tokens`` capped
        to stay within the model length. A request that is no open session, or has no room left, is left alone and
        the call left out of the program. Returns whether it was sent."""
        turn = self.sessions.plan(request, prompt, max_tokens, self.outputs)
        if turn is None:
            return False
        self._perform(Resume(request, turn.prompt, turn.max_tokens))
        session = self.sessions.open[request]
        self.scheduler.add_request(
            new_request(
                request,
                list(turn.prompt),
                turn.max_tokens,
                self.setup.hash_block_size,
                len(self.lengths),
                session.priority,
                session.cache_salt,
                turn_ending(session.ending, turn.max_tokens),
                session.lora,
                resumable=True,
                full_reports=full_reports(self.setup, request),
                skip_reads=skips_reads(self.setup, request),
            )
        )
        started = self.sessions.sent(request, turn, self.outputs)
        self.lengths[request] = self.sessions.planned_length(request, self.outputs) + turn.max_tokens
        if started is not None:
            self._started([started])
            self.sessions.check_held(self.scheduler, self.outputs, self.steps, _block_hashes(self.setup))
        return True

    def _started(self, turns: list[Started]) -> None:
        """Tell the worker the tokens each session that began a turn is to be scheduled anew with."""
        for turn in turns:
            self.worker.session_inputs.setdefault(turn.request, []).append(list(turn.tokens))

    def _close_sessions(self) -> None:
        """Arrivals stopped: close every open session, as its client does (a request of its id, not resumable)."""
        for request in self.sessions.close_all():
            session_end = new_request(request, [0], 1, self.setup.hash_block_size, len(self.lengths))
            self.scheduler.add_request(session_end)

    def _perform(self, operation: Operation) -> None:
        """Record ``operation``, about to run, in the program and the journal."""
        self.program.append(operation)
        if self.journal is not None:
            self.journal.call(operation.to_json())

    def abort(self, request: str) -> None:
        """Abort a request, as a client disconnecting does (a finished one is left alone, as vLLM leaves it). An abort
        of a request that has finished for vLLM and for the client alike changes nothing, and is left out of the
        program (so a shrunk trace holds none)."""
        held = self.scheduler.requests.get(request)
        if (held is None or held.is_finished()) and self.outputs.requests[request].finished:
            return
        self._perform(Abort(request))
        self.scheduler.finish_requests(request, vllm().RequestStatus.FINISHED_ABORTED)
        self.outputs.aborted(request)
        self.stats.finished(request)
        self.sessions.aborted(request)

    def reset_prefix_cache(self, preempt: bool = False) -> bool:
        """Reset the prefix cache, as a client does after it updates the weights (``preempt``: the running requests
        preempted first), and check what the reset promises (:mod:`kvfuzz.scheduler.prefix_reset`); returns whether
        it reset."""
        self._perform(ResetPrefixCache(preempt))
        if preempt:
            self.stats.reset_preempted()
        return self.resets.reset(self.scheduler, self.worker, preempt, self.steps)

    def pause(self, keep: bool = False) -> None:
        """Pause the scheduler, as the engine core's ``pause_scheduler`` does (``keep``: nothing scheduled; else no new
        request started) until :meth:`unpause` (:mod:`kvfuzz.scheduler.pausing`)."""
        self._perform(Pause(keep))
        self.pausing.pause(self.scheduler, keep)

    def unpause(self) -> None:
        """Resume a paused scheduler, as the engine core's ``resume_scheduler`` does."""
        self._perform(Unpause())
        self.pausing.unpause(self.scheduler)

    def known_requests(self) -> list[KnownRequest]:
        """Every request added so far, with its tokens as kvfuzz knows them (the prompt, then its outputs so far)."""
        adds = (operation for operation in self.program if isinstance(operation, AddRequest))
        return [
            KnownRequest(request, tuple(self._tokens_of(request, add)), add.cache_salt, add.lora)
            for request, add in zip(self.lengths, adds)
        ]

    def _tokens_of(self, request: str, add: AddRequest) -> list[int]:
        """``request``'s tokens as the client knows them: a session's current ones, or its prompt and outputs."""
        tokens = self.sessions.tokens(request, self.outputs)
        return list(add.prompt) + self.outputs.requests[request].received if tokens is None else tokens

    def step(self) -> int:
        """One engine step the client asked for, every check run; returns the tokens it scheduled."""
        self._perform(Step())
        return self._step().scheduled

    def _step(self) -> Progress:
        """One engine step (the client's, or the drain's), every check run. A step that runs past the watchdog's
        limit is a :attr:`Check.HANG` violation (a ``schedule()`` stuck in a loop is a finding, not a stuck search)."""
        return bounded_step(
            self.watchdog,
            self.steps + 1,
            "schedule(), the worker, update_from_output()",
            lambda: self.loop.step(self),
        )

    def has_requests(self) -> bool:
        return bool(self.scheduler.has_requests())

    def draft_counts(self) -> tuple[int, int]:
        """Speculative drafts the scheduler scheduled, and those the worker accepted, so far."""
        stats = self.worker.speculation.stats
        return stats.scheduled, stats.accepted

    def released_rewrites(self) -> int:
        """Released blocks rewritten while a step reading them was still in flight (in order), so far."""
        return int(self.loop.rewrites)

    def transfer_counts(self) -> TransferTally:
        """The KV connector's stores, loads, failed loads, late reports and flushes so far (zero without one)."""
        return self.connector.tally

    def lora_held_back(self) -> int:
        """Steps so far after which vLLM's adapter limit held a waiting request back (0 without LoRA)."""
        return self.held_back

    def busy(self) -> bool:
        """Whether a step has anything to do: requests in the scheduler, or batches in flight."""
        return self.has_requests() or bool(self.loop.in_flight()) or self.connector.pending()

    def launch(self) -> Batch:
        """Schedule a step and run it on the worker (the model runner's ``execute_model``); its output is returned
        to the scheduler by :meth:`collect`."""
        output = self.scheduler.schedule()
        self.steps += 1
        self.observer.stepped(self, output.num_scheduled_tokens)
        self.sessions.check_scheduled(output.num_scheduled_tokens, self.steps)
        self.preemptions += len(output.preempted_req_ids or ())
        self.stats.preempted(output.preempted_req_ids or ())
        self.held_back += int(limit_held_back(self.scheduler, self.setup.max_loras))
        cached = output.scheduled_cached_reqs
        resumed = self.worker.release.resumed(cached)
        admitted = [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs] + [
            (request, computed)
            for request, computed in zip(cached.req_ids, cached.num_computed_tokens)
            if request in resumed
        ]
        for request, computed in admitted:
            self.hit_tokens += computed
            self.stats.admitted(request, self._known_tokens(request), computed)
        self.worker.consume(output, self.steps)
        self.connector.consume(output, self.worker, self.steps)
        self._check_accounting()
        self.oracles.stepped(step_events(output, resumed, self.worker.computed, self.steps))
        self.loop.before_execute(output, self.worker, self.steps)
        self.connector.before_forward(output, self.worker, self.steps)
        order, sampled = self.worker.execute(output, self.steps)
        connector = self.connector.after_forward(output, self.worker, self.steps)
        result = self.worker.release.runner_output(vllm().ModelRunnerOutput, order, sampled, connector)
        return Batch(self.steps, output, result, int(output.total_num_scheduled_tokens))

    def collect(self, batch: Batch) -> None:
        """``update_from_output()`` with a launched step's output, and the output check; then, as the engine core's
        ``post_step`` (synchronous scheduling only), the worker's drafts for the next step."""
        outputs = self.scheduler.update_from_output(batch.output, batch.result)
        self.outputs.receive(outputs, batch.step, self.connector.failing(batch.step))
        self.worker.speculation.returned(batch.step)  # its rejected drafts rolled back
        self.connector.collected(batch.step)
        for finished in (output.request_id for eco in outputs.values() for output in eco.outputs if output.finished):
            self.stats.finished(finished)
        if self.sessions.open:
            self._started(self.sessions.after_outputs(self.outputs))
            self.sessions.check_held(self.scheduler, self.outputs, batch.step, _block_hashes(self.setup))
        self.events.check(self.scheduler, self.known_requests, batch.step)
        self.stats.check(self.scheduler, outputs, self._unfinished_or_open(), batch.step)
        drafts = self.worker.take_draft_token_ids()
        if drafts is not None and batch.scheduled > 0:
            self.scheduler.update_draft_token_ids(vllm().DraftTokenIds(*drafts))

    def drain(self) -> None:
        """Arrivals stopped: run steps until every request has finished and no batch is in flight, within
        :func:`drain_bound`; then steps until the scheduler has nothing left to tell the worker (the last finished
        requests), after which it holds no table and every block is free (the accounting check, once more)."""
        self._close_sessions()
        if self.pausing.state is not Paused.UNPAUSED:  # the client resumes the scheduler once arrivals stop
            self.pausing.unpause(self.scheduler)
        unfinished = self.outputs.unfinished()
        bound = drain_bound(sum(self.lengths[request] for request in unfinished))
        for _ in range(bound):
            if not self.outputs.unfinished() and not self.loop.in_flight():
                break
            transfers = self.connector.pending() or self.connector.transfers()
            preempted = self.preemptions
            if not self._step():
                stuck = self.outputs.unfinished()
                # a step that only completes transfers, or orders a load, is progress too; so is one that preempts
                # (a session waiting with blocks can leave the one running request no block but its own: vLLM
                # preempts it, and admits nothing in that step)
                if (
                    not stuck
                    or transfers
                    or self.connector.pending()
                    or self.connector.transfers() != transfers
                    or self.preemptions != preempted
                ):  # only empty batches, or transfers, were in flight
                    continue
                raise SchedulerViolation(
                    Check.PROGRESS,
                    self.steps,
                    stuck[0],
                    f"the step scheduled nothing while {len(stuck)} request(s) are unfinished: {self._describe(stuck)}",
                    stuck_cause("a drain step scheduled nothing", self.scheduler, self.setup, stuck),
                )
        unfinished = self.outputs.unfinished()
        if unfinished:
            raise SchedulerViolation(
                Check.PROGRESS,
                self.steps,
                unfinished[0],
                f"{len(unfinished)} request(s) still unfinished {bound} steps after arrivals stopped: "
                f"{self._describe(unfinished)}",
                stuck_cause("the drain ran past its bound", self.scheduler, self.setup, unfinished),
            )
        for _ in range(DEPTH + 1 + self.connector.drain_steps):
            if not self.busy():
                # quiescent: the worker was told of every finish, so it holds no table and every block is free
                self._check_accounting()
                self.events.flush(self.scheduler, self.known_requests, self.steps)
                return
            self._step()
        in_flight = self.loop.in_flight()
        left = (
            f"the batch(es) of step(s) {in_flight} are still in flight (their output never returned)"
            if in_flight
            else f"the scheduler still has {self.scheduler.get_num_unfinished_requests()} unfinished request(s)"
        )
        raise SchedulerViolation(
            Check.PROGRESS,
            self.steps,
            None,
            f"every request finished, but {DEPTH + 1 + self.connector.drain_steps} steps later {left}",
            "work left after every request finished",
        )

    def snapshot(self, scheduled: Mapping[str, int]) -> StepSnapshot:
        """Every request added so far as vLLM holds it now (``scheduled``: the tokens the step just scheduled); read
        without touching vLLM's state (its managers' ``req_to_blocks`` are defaultdicts: a lookup would add one)."""
        aborted = {operation.request for operation in self.program if isinstance(operation, Abort)}
        groups = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        requests: dict[str, RequestAtStep] = {}
        for request in self.lengths:
            held: Any = self.scheduler.requests.get(request)
            if held is None:
                gone = "aborted" if request in aborted else "finished"
                requests[request] = RequestAtStep(gone, gone.upper())
                continue
            count = scheduled.get(request, 0)
            blocks = tuple(
                block.block_id
                for group in groups
                for block in group.req_to_blocks.get(request, ())
                if not block.is_null
            )
            status = held.status.name
            requests[request] = RequestAtStep(
                _state_of(status, count), status, count, int(held.num_computed_tokens), blocks
            )
        return StepSnapshot(self.steps, requests)

    def _unfinished_or_open(self) -> list[str]:
        """The requests the client still expects something of: unfinished ones, and open streaming sessions (a
        paused session's turn finished, but the session waits in the scheduler for its next input)."""
        return sorted(set(self.outputs.unfinished()) | set(self.sessions.open))

    def _known_tokens(self, request: str) -> int:
        """``request``'s prompt and the outputs reported for it so far."""
        expected = self.outputs.requests[request]
        return expected.prompt_length + len(expected.received)

    def _check_accounting(self) -> None:
        """The accounting check against the blocks the worker's live tables hold, in every KV-cache group."""
        held, maybe = self.worker.holdings()
        sending, deferred = self.connector.holding()  # a send's blocks, and blocks vLLM may hold back for steps
        for request, blocks in sending.items():
            held.setdefault(request, []).extend(blocks)
        for request, blocks in deferred.items():
            maybe.setdefault(request, []).extend(blocks)
        waiting = {request.request_id for request in getattr(self.scheduler, "kv_holding_waiting", ())}
        for request in sorted(waiting | self.connector.loading()):
            # a request waiting with blocks (its load in flight, or finished and not scheduled since; an aborted one
            # keeps them until its load finished): the worker learns its table when it is scheduled, so it is held
            # to the manager's own, in every group
            if request in self.scheduler.requests and request not in held:
                groups = self.scheduler.kv_cache_manager.get_block_ids(request)
                held[request] = [block for blocks in groups for block in blocks if block != 0]
        check_accounting(self.scheduler, held, self.steps, maybe)

    def _describe(self, requests: list[str]) -> str:
        """Each request's status in the scheduler, its computed tokens and its output so far."""
        described = []
        for request in requests:
            held = self.scheduler.requests.get(request)
            status = (
                "unknown to the scheduler"
                if held is None
                else f"{held.status.name}, {held.num_computed_tokens} computed"
            )
            expected = self.outputs.requests[request]
            described.append(f"{request} ({status}, {len(expected.received)} of {expected.length} output tokens)")
        return "; ".join(described)


def _block_hashes(setup: SchedulerSetup) -> Callable[[str, list[int], Optional[str], int], list[Any]]:
    """The block hashes vLLM's request block hasher gives a request's tokens under its cache salt and adapter."""

    def hashes(request: str, tokens: list[int], cache_salt: Optional[str], lora: int) -> list[Any]:
        return list(
            new_request(request, tokens, 1, setup.hash_block_size, 0, 0, cache_salt, Ending(), lora).block_hashes
        )

    return hashes


def _connector(
    setup: SchedulerSetup, scheduler: Any, loop: EngineLoop
) -> Union[NoConnector, OffloadingWorker, PDWorker]:
    """The worker side of ``setup``'s KV connector: the P/D connector's reads vLLM's pool and the steps in flight."""
    return PDWorker(setup, scheduler, loop) if setup.kv_connector == "pd" else connector_for(setup)


def _state_of(status: str, scheduled: int) -> str:
    """The lane state of a request vLLM still holds, from its ``RequestStatus`` name and the tokens scheduled."""
    if status == "FINISHED_ABORTED":
        return "aborted"
    if status.startswith("FINISHED"):
        return "finished"
    if status == "WAITING_FOR_REMOTE_KVS":
        return "loading"
    if status == "PREEMPTED":
        return "preempted"
    if status == "RUNNING":
        return "running" if scheduled else "idle"
    return "running" if scheduled else "waiting"
