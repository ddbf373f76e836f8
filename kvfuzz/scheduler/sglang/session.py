"""One example against SGLang's scheduling loop, kvfuzz as the model: at each step the loop's batch is run by
writing the K/V of every token it schedules at the slots SGLang's batch gives (``out_cache_loc``, which
``prepare_for_extend`` / ``prepare_for_decode`` allocate and write into ``req_to_token``: SGLang's own write path),
checking what every scheduled request attends to through its ``req_to_token`` row (SGLang's read path), and sampling
the fake model's tokens; then the loop processes the result and the outputs and the pool's accounting are checked.

The content and exclusive-write checks are the vLLM target's (:mod:`kvfuzz.scheduler.kv_slots`), over SGLang's
token slots: slot ``s`` is page ``s // block_size``; page 0 is SGLang's padding page."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

from kvfuzz.program.safeguards import Journal, Watchdog
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.ending import Ending
from kvfuzz.scheduler.engines import installed_version
from kvfuzz.scheduler.fake_model import sampled_token
from kvfuzz.scheduler.kv_slots import Claims, SlotPool
from kvfuzz.scheduler.offloading import TransferTally
from kvfuzz.scheduler.outputs import OutputLedger
from kvfuzz.scheduler.program import Abort, AddRequest, Operation, Step
from kvfuzz.scheduler.session import drain_bound
from kvfuzz.scheduler.sglang.accounting import check_accounting
from kvfuzz.scheduler.sglang.loop import SchedulerLoop
from kvfuzz.scheduler.sglang.stuck import stuck_cause
from kvfuzz.scheduler.snapshot import NO_OBSERVER, RequestAtStep, StepObserver, StepSnapshot
from kvfuzz.scheduler.step_watchdog import bounded_step
from kvfuzz.scheduler.trace import journal_configuration
from kvfuzz.scheduler.violations import Check, SchedulerViolation

Sampler = Callable[[str, int], int]
"""The fake model's token for a request at a position (the engine tests seed a broken model)."""


class SGLangSession:
    """A fresh loop, kvfuzz's K/V pool and the output ledger; ``steps`` counts batches run. Each step is bounded by
    ``watchdog`` (entered by the caller) when one is given, and each operation is kept in ``journal`` before it runs
    when one is given (an isolated campaign batch's)."""

    def __init__(
        self,
        setup: SchedulerSetup,
        sampler: Sampler = sampled_token,
        watchdog: Optional[Watchdog] = None,
        journal: Optional[Journal] = None,
    ) -> None:
        self.setup = setup
        self.watchdog = watchdog  # interrupts a step that runs past its limit (None: no limit); entered by the caller
        self.journal = journal  # keeps the program on disk, each operation before it runs (None: only in memory)
        self.loop = SchedulerLoop(setup)  # SGLang's scheduling pieces in kvfuzz's copy of the Scheduler's loop
        self.kv = SlotPool((setup.num_blocks + 1) * setup.block_size, setup.block_size)  # page 0 included
        self.sampler = sampler
        self.outputs = OutputLedger()
        self.tokens: dict[str, list[int]] = {}  # request -> its prompt and the tokens sampled for it
        self.computed: dict[str, int] = {}  # request -> positions whose K/V it relies on (0 while waiting)
        self.aborted: set[str] = set()  # requests the client aborted
        self.lengths: dict[str, int] = {}
        self.steps = 0
        self.hit_tokens = 0
        self.program: list[Operation] = []
        self.observer: StepObserver = NO_OBSERVER  # told of each step as soon as it is scheduled (kvfuzz show)
        if journal is not None:
            journal.begin_example(journal_configuration(setup, ""))  # no model runner to record

    @property
    def engine(self) -> str:
        """What a harness error names as driven: SGLang and its installed version (read when asked)."""
        return f"SGLang {installed_version('sglang')}"

    @property
    def preemptions(self) -> int:
        return int(self.loop.retractions)

    def draft_counts(self) -> tuple[int, int]:
        """Speculative drafts scheduled and accepted: none (speculative decoding is not driven on SGLang)."""
        return 0, 0

    def released_rewrites(self) -> int:
        """Released blocks rewritten while a step reading them was in flight: none (no overlap scheduling)."""
        return 0

    def lora_held_back(self) -> int:
        """Steps after which a LoRA adapter limit held a request back: none (no LoRA is driven on SGLang)."""
        return 0

    def transfer_counts(self) -> TransferTally:
        """A KV connector's transfers: none (no connector is driven on SGLang)."""
        return TransferTally()

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
        """Add a request (ids ``r0``, ``r1``, ...), ending at the model's EOS token with ``eos`` (ignoring it
        without, SGLang's ``ignore_eos``); ``priority`` must be 0, ``cache_salt`` None, ``stop_token_ids`` empty,
        ``min_tokens`` 0, ``lora`` 0 and ``resumable`` false (priority scheduling, cache salts, stop tokens,
        min_tokens, LoRA and resumable requests are not driven on SGLang)."""
        if priority or cache_salt is not None or stop_token_ids or min_tokens or lora or resumable:
            raise ValueError(
                "the SGLang target drives no priority, cache salt, stop tokens, min_tokens, LoRA or resumable requests "
                f"(priority {priority}, cache salt {cache_salt!r}, stop tokens {list(stop_token_ids)}, "
                f"min_tokens {min_tokens}, lora {lora}, resumable {resumable})"
            )
        request = f"r{len(self.lengths)}"
        self._perform(AddRequest(prompt, max_tokens, eos=eos))
        finishes_with = self.loop.add_request(request, prompt, max_tokens, eos)
        self.outputs.added(request, len(prompt), max(finishes_with, 0), Ending(eos=eos))
        if finishes_with < 0:  # refused by SGLang's validation: finished at once, with no output
            self.outputs.aborted(request)
            self.aborted.add(request)
        self.tokens[request] = list(prompt)
        self.computed[request] = 0
        self.lengths[request] = len(prompt) + max_tokens
        return request

    def abort(self, request: str) -> None:
        self._perform(Abort(request))
        self.loop.abort(request)
        self.outputs.aborted(request)
        self.aborted.add(request)

    def busy(self) -> bool:
        """Whether a step has anything to do: requests waiting, running or being prefilled."""
        return bool(self.loop.has_requests())

    def step(self) -> int:
        self._perform(Step())
        return self._step()

    def _perform(self, operation: Operation) -> None:
        """Record ``operation``, about to run, in the program and the journal."""
        self.program.append(operation)
        if self.journal is not None:
            self.journal.call(operation.to_json())

    def _step(self) -> int:
        """One step (the client's, or the drain's), bounded by the watchdog: a step that runs past its limit is a
        :attr:`Check.HANG` violation naming where it was interrupted."""
        return bounded_step(
            self.watchdog,
            self.steps + 1,
            "get_next_batch_to_run(), kvfuzz's model, process_batch_result()",
            self._run_step,
        )

    def _run_step(self) -> int:
        """One ``get_next_batch_to_run``, the batch run by kvfuzz, ``process_batch_result``, every check."""
        loop = self.loop
        batch = loop.next_batch()
        self.steps += 1
        for request, req in loop.requests.items():  # a retracted request relies on nothing
            if req.is_retracted or not req.kv.holds_kv:
                self.computed[request] = 0
        if batch is None:
            self.observer.stepped(self, {})
            self._check_accounting()
            return 0
        extend = batch.forward_mode.is_extend()
        reqs = list(batch.reqs)
        if extend:
            starts = [int(n) for n in batch.prefix_lens]
            counts = [int(n) for n in batch.extend_lens]
        else:  # prepare_for_decode has counted the new token into seq_lens
            starts = [int(n) - 1 for n in batch.seq_lens.tolist()]
            counts = [1] * len(reqs)
        self.observer.stepped(self, {req.rid: count for req, count in zip(reqs, counts)})
        write_slots = [int(s) for s in batch.out_cache_loc.tolist()]
        if len(write_slots) != sum(counts):
            raise SchedulerViolation(
                Check.CONTENT,
                self.steps,
                reqs[0].rid,
                f"the batch writes {len(write_slots)} slots (out_cache_loc) for {sum(counts)} scheduled tokens",
                "a batch writing other than one slot per scheduled token",
            )
        taken = self._relied_on()
        offset = 0
        for req, start, count in zip(reqs, starts, counts):
            if extend:
                self.hit_tokens += start if start > self.computed[req.rid] else 0
            self._write(req.rid, start, count, write_slots[offset : offset + count], taken)
            offset += count
        sampled = []
        for req, start, count in zip(reqs, starts, counts):
            end = start + count
            self._check_content(req, end)
            self.computed[req.rid] = end
            tokens = self.tokens[req.rid]
            if end == len(tokens):
                token = self.sampler(req.rid, end)
                tokens.append(token)
                sampled.append(token)
            else:
                sampled.append(0)  # a chunk's token, which SGLang discards
        loop.process(batch, sampled)
        for req in reqs:
            self._receive(req)
        self._check_accounting()
        return sum(counts)

    def snapshot(self, scheduled: Mapping[str, int]) -> StepSnapshot:
        """Every request added so far as SGLang's loop holds it now (``scheduled``: the tokens of the batch just
        formed); its blocks are the pages of its ``req_to_token`` row up to its allocated length (page 0, SGLang's
        padding page, left out)."""
        loop = self.loop
        requests: dict[str, RequestAtStep] = {}
        for request in self.lengths:
            req: Any = loop.requests[request]
            count = scheduled.get(request, 0)
            if req.finished():
                state = "aborted" if request in self.aborted else "finished"
            elif req.is_retracted:
                state = "preempted"
            elif req in loop.waiting_queue:
                state = "waiting"
            else:
                state = "running" if count else "idle"
            where = "waiting queue" if req in loop.waiting_queue else "finished" if req.finished() else "running batch"
            slots = self._row(req, int(req.kv.kv_allocated_len)) if req.kv.holds_kv else []
            pages = sorted({slot // self.setup.block_size for slot in slots} - {0})
            requests[request] = RequestAtStep(state, where, count, self.computed.get(request, 0), tuple(pages))
        return StepSnapshot(self.steps, requests)

    def _write(self, request: str, start: int, count: int, slots: list[int], taken: Claims) -> None:
        tokens = self.tokens[request]
        if start + count > len(tokens):
            raise SchedulerViolation(
                Check.CONTENT,
                self.steps,
                request,
                f"positions {start}..{start + count - 1} scheduled, but the request has only {len(tokens)} tokens",
                "positions scheduled past the request's tokens",
            )
        self.kv.write(request, tokens[: start + count], range(start, start + count), slots, self.steps, taken)

    def _row(self, req: object, end: int) -> list[int]:
        """The request's slots for positions ``0 .. end - 1``, as attention reads them: its ``req_to_token`` row."""
        pool = self.loop.pools.req_to_token_pool
        return [int(s) for s in pool.req_to_token[req.kv.req_pool_idx, :end].tolist()]  # type: ignore[attr-defined]

    def _check_content(self, req: object, end: int) -> None:
        rid = req.rid  # type: ignore[attr-defined]
        self.kv.check(rid, self.tokens[rid][:end], self._row(req, end), self.steps)

    def _relied_on(self) -> Claims:
        """The claims of the requests holding KV (running, chunked, or this batch's) on the positions they computed,
        slot by slot (SGLang's token rows)."""
        claims = self.kv.claims()
        for request, req in self.loop.requests.items():
            computed = self.computed[request]
            if computed and req.kv.holds_kv and not req.finished():
                slots = self._row(req, computed)
                claims.rely_on_slots(request, self.tokens[request][:computed], slots)
        return claims

    def _receive(self, req: object) -> None:
        """The tokens SGLang appended to the request's ``output_ids`` this step, checked against the fake model."""
        rid = req.rid  # type: ignore[attr-defined]
        if rid in self.aborted:
            return
        received = self.outputs.requests[rid].received
        # what SGLang reports: its output_ids up to finished_len (a prefill-only request, max_new_tokens clipped to 0,
        # appends a token at its prefill and finishes with none)
        output = list(req.output_ids_through_stop)  # type: ignore[attr-defined]
        new = output[len(received) :]
        if output[: len(received)] != received:
            raise SchedulerViolation(
                Check.OUTPUTS,
                self.steps,
                rid,
                f"output_ids {output} no longer start with {received}",
                "tokens already reported changed",
            )
        self.outputs.record(rid, new, req.finished(), self.steps)  # type: ignore[attr-defined]
        sampled = self.tokens[rid][self.outputs.requests[rid].prompt_length :]
        if output != sampled[: len(output)] or len(output) < len(sampled) - 1:
            raise SchedulerViolation(
                Check.OUTPUTS,
                self.steps,
                rid,
                f"SGLang holds output {output}, but the fake model sampled {sampled} for it",
                "the engine's output other than the tokens sampled",
            )

    def _check_accounting(self) -> None:
        check_accounting(self.loop, self.steps)

    def drain(self) -> None:
        unfinished = self.outputs.unfinished()
        bound = drain_bound(sum(self.lengths[request] for request in unfinished))
        for _ in range(bound):
            if not self.loop.has_requests():
                break
            if self._step() == 0 and self.outputs.unfinished():
                stuck = self.outputs.unfinished()
                raise SchedulerViolation(
                    Check.PROGRESS,
                    self.steps,
                    stuck[0],
                    f"the step scheduled nothing while {len(stuck)} request(s) are unfinished: {self._describe(stuck)}",
                    stuck_cause("a drain step scheduled nothing", self.loop, self.setup, stuck),
                )
        unfinished = self.outputs.unfinished()
        if unfinished or self.loop.has_requests():
            raise SchedulerViolation(
                Check.PROGRESS,
                self.steps,
                unfinished[0] if unfinished else None,
                f"{len(unfinished)} request(s) still unfinished {bound} steps after arrivals stopped: "
                f"{self._describe(unfinished)}",
                stuck_cause("the drain ran past its bound", self.loop, self.setup, unfinished),
            )

    def _describe(self, requests: list[str]) -> str:
        loop = self.loop
        described = []
        for request in requests:
            req = loop.requests[request]
            where = (
                "waiting"
                if req in loop.waiting_queue
                else "chunked"
                if req is loop.chunked_req
                else "running"
                if req in loop.running_batch.reqs
                else "nowhere in the loop"
            )
            expected = self.outputs.requests[request]
            described.append(f"{request} ({where}, {len(expected.received)} of {expected.max_tokens} output tokens)")
        return "; ".join(described)
