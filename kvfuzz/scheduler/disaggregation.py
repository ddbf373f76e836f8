"""kvfuzz as the worker side of its P/D-disaggregation connector (the scheduler side:
:mod:`kvfuzz.scheduler.pd_connector`, which vLLM builds): the remote producer's loads and the sends to a remote
decoder, performed and reported in the ``ModelRunnerOutput``'s ``kv_connector_output``, and the checks on the
blocks they and vLLM's deferred frees protect.

The protocol: a step's connector metadata orders loads (a request's remote prefix into its blocks) and sends (a
finished request's blocks, whose free vLLM delays). A sync load is performed before the step's forward pass; an
async load and a send complete ``delay`` steps after the step that submitted them (0 to ``transfer_delay``, drawn
per transfer from the request, so a replay draws the same), reported in that step's ``finished_recving`` or
``finished_sending``. A completed load writes the remote prefill's K/V (the reference's, under the request's
namespace) into the slots of the positions it fills in every attention group, so the content check then holds every
loaded token to it; on a Mamba hybrid it also writes the state after its last token into each Mamba group's block
for that state (as NIXL transfers the state-bearing block), so the Mamba state check holds the request's resumption
to it.

With ``load_failures`` an async load fails one time in three (drawn per request): part-way, its first blocks written
and the rest reported in ``invalid_block_ids`` (two failures in three), or whole, nothing written and the request
reported in ``failed_recving``; both beside the request's ``finished_recving``, as a connector reports a load that
ended. With several KV-cache groups (the Mamba hybrid) every failure is whole: block ids are unique only within a
group, so vLLM takes load failures there by request only (it refuses ``invalid_block_ids``). vLLM's recovery
(``kv_load_failure_policy="recompute"``) must then count as computed only the positions before the first failed
block and recompute the rest: a step that reads a position a failed load left unwritten, or a
prefix-cache hit on such a block, fails the content check, which names the failed load as the cause. Under the
``fail`` policy (``SchedulerSetup.load_failure_policy``) vLLM must instead finish the request with an error as it
processes the output that reports the failure (:meth:`PDWorker.failing` tells the output check which requests), and
no other request: the output check holds it to that, and the content check still to never reading what the load
left unwritten. Sync loads do not fail (the step that performs one reads the load's positions at once, so vLLM
discards its output: a recovery kvfuzz does not model).

Under async scheduling a KV-consumer connector turns vLLM's ``defer_block_free`` on: a request's blocks released
while a step that scheduled it is in flight go back to the pool only once that step's output was processed (a load
is not ordered on the device's stream, so a block reused by a load could be written while the old step still
reads it). Invariants the worker holds vLLM to (:attr:`Check.DELAYED_FREE`), at each step, once the scheduler's
output has been read:

* a block of a send in flight (from the step whose metadata ordered it until the output reporting it was
  processed) is not in the free queue, not newly held by another request beyond its prefix-cache hit, not the
  target of a load, and not written by a step;
* with deferred frees, a block a request released while a step in flight reads it for that request is likewise
  not in the free queue, not reallocated (newly held beyond a prefix-cache hit, or a load's target) until that step's
  output was processed;
* a block a *running* request released while a step in flight reads it for that request (a Mamba group's earlier
  state block, left as the state moved on: vLLM frees it at once, since a later step runs after the one in flight on
  the device) is not a load's target until that step's output was processed (a load is not ordered on that stream).

And (:attr:`Check.TRANSFER`): a load lands only in blocks its request holds (in the manager's table for it, not
free), from its submission to its completion; an async load's blocks are all among those vLLM hands the connector as
not yet cached (``get_unhashed_block_ids_all_groups``, what a P2P connector such as NIXL's writes a load into: a
block still carrying a hash there would go unloaded); no step reads or writes a block an async load has not
finished.

The accounting check counts a send's blocks as its request's until the send's report was processed, and a
deferred block as possibly held until the steps in flight when it was released returned (a block copy's two ends
too, which vLLM retains until the step that runs the copy returned); so a delayed block never freed (a leak) fails
it."""

from __future__ import annotations

import zlib
from typing import Any, Optional

import attrs

from kvfuzz.reference.content import prefix_tags
from kvfuzz.scheduler.config import SchedulerSetup
from kvfuzz.scheduler.groups import group_namespace
from kvfuzz.scheduler.kv_slots import Write
from kvfuzz.scheduler.offloading import TransferTally, step_blocks
from kvfuzz.scheduler.violations import Check, SchedulerViolation


def _draw(*parts: object) -> int:
    """A deterministic draw from ``parts`` (the same in every run and replay)."""
    return zlib.crc32(repr(parts).encode())


@attrs.frozen
class RemoteLoad:
    """A load submitted: what the metadata ordered (a :class:`~kvfuzz.scheduler.pd_connector.Load`), the step whose
    metadata ordered it, and the step whose output reports it (the same step for a sync load)."""

    load: Any
    ordered: int
    due: int
    salt: tuple[str, ...]  # the request's K/V namespace, its cache salt (the worker forgets it once it finished)
    # per KV-cache group, the blocks the load writes: an attention group's blocks of the positions it fills (in block
    # id order), a Mamba group's state block (the state after the load's last token); see PDWorker._targets
    targets: tuple[tuple[int, ...], ...]
    filled: Optional[int] = None  # blocks of its targets it fills before it fails; None: it does not fail
    whole: bool = False  # it fails whole (fills nothing), reported in failed_recving rather than by its blocks

    @property
    def request(self) -> str:
        return str(self.load.request)

    @property
    def blocks(self) -> list[int]:
        """Every block the load writes, group after group."""
        return [block for group in self.targets for block in group]


@attrs.frozen
class RemoteSend:
    """A send submitted: the request, the blocks vLLM keeps for it (those of its computed tokens, which the send
    reads, and the rest of its last table: a draft's lookahead slots, say), the step that ordered it and the step
    whose output reports it."""

    request: str
    blocks: tuple[int, ...]
    ordered: int
    due: int


@attrs.frozen
class Released:
    """A block a request released (no live table of it holds it), first seen released at launch ``seen``."""

    request: str
    seen: int
    # released by a request still running: a Mamba group's earlier state block, left as its state moved on. vLLM
    # frees it at once (only a finished or preempted request's blocks are deferred), and rightly so for the steps,
    # which run in order on the device after the one in flight; a load, which does not, must not fill it yet
    running: bool = False


class PDWorker:
    """The worker side of the P/D connector over the worker's slot pool; ``scheduler`` is vLLM's, read for its
    pool and its own tables, ``loop`` the engine loop (its ``readers``: the blocks the steps in flight read).

    Invariants: ``loads`` holds every load submitted and not yet reported (request -> load); ``sends`` every send
    submitted whose report has not been processed; ``released`` (with deferred frees) the blocks requests released
    while a step launched before was in flight, until every such step returned."""

    def __init__(self, setup: SchedulerSetup, scheduler: Any, loop: Any) -> None:
        self.max_delay = setup.transfer_delay  # the most steps a load or send completes late
        self.load_failures = setup.load_failures  # whether async loads may fail (part-way or whole)
        self.fails_requests = setup.load_failure_policy == "fail"  # a failed load fails its request (vLLM's policy)
        self.block_size = setup.block_size
        self.deferring = setup.async_scheduling  # vLLM defers block frees: a consumer, two batches in flight
        self.scheduler = scheduler
        self.loop = loop
        self.loads: dict[str, RemoteLoad] = {}
        self.ordered: list[RemoteLoad] = []  # the loads the step being launched ordered, submitted before its forward
        self.sends: dict[str, RemoteSend] = {}
        self.reported: dict[str, int] = {}  # send's request -> the step whose output reported it
        self.received: dict[str, int] = {}  # async load's request -> the step whose output reported it
        # under the "fail" policy: a failed async load's request -> the step whose output reported it
        self.failed: dict[str, int] = {}
        self.released: dict[int, list[Released]] = {}  # block -> who released it, while steps before are in flight
        # with deferred frees: a step with block copies -> their ends (source and destination), which vLLM retains (a
        # reference each) until that step's output was processed (``_free_cow_retained_blocks``: the copies run with
        # the step)
        self.retained: dict[int, list[int]] = {}
        self.last_held: dict[str, set[int]] = {}  # the live tables at the last launch
        # the same, of the attention groups alone: what vLLM keeps of a sent request's tables (at its finish a Mamba
        # group's earlier state blocks are freed, and only its state-bearing block is handed over and kept)
        self.last_attention: dict[str, set[int]] = {}
        self.tally = TransferTally()

    @property
    def drain_steps(self) -> int:
        """Steps the drain adds once every request finished: the step that submits the last sends, and the most
        steps they may report late."""
        return 1 + self.max_delay

    def pending(self) -> bool:
        return bool(self.loads or self.sends)

    def loading(self) -> set[str]:
        """The requests with an async load in flight, or reported and the report not yet processed."""
        return set(self.loads) | set(self.received)

    def transfers(self) -> int:
        return self.tally.loads + self.tally.sends

    # -- the step ------------------------------------------------------------------------------------------------

    def consume(self, output: Any, worker: Any, step: int) -> None:
        """The scheduler's output was read: learn the step's loads and sends, note the blocks released since the last
        launch, and check the blocks sends and deferred frees protect."""
        meta = output.kv_connector_metadata
        self.ordered = [
            RemoteLoad(load, step, step, worker.namespaces[load.request], self._targets(load, worker, step))
            for load in meta.loads
        ]
        for send in meta.sends:
            kept = tuple(sorted(set(send.blocks) | self.last_attention.get(send.request, set())))
            self.sends[send.request] = RemoteSend(send.request, kept, step, self._due("send", send.request, step))
        held = {request: set(blocks) for request, blocks in worker.holdings()[0].items()}
        in_flight = self.loop.in_flight()
        if self.deferring and output.kv_cache_block_copies:
            self.retained[step] = [end for copy in output.kv_cache_block_copies for end in copy]
        for block in list(self.released):
            self.released[block] = [entry for entry in self.released[block] if in_flight and in_flight[0] < entry.seen]
            if not self.released[block]:
                del self.released[block]
        if self.deferring and in_flight:
            for request, blocks in self.last_held.items():
                for block in sorted(blocks - held.get(request, set())):
                    self.released.setdefault(block, []).append(Released(request, step, request in held))
        self._check_protected(output, worker, held, step)
        self.last_held = held
        self.last_attention = {request: set(blocks) for request, blocks in worker.attention_holdings()[0].items()}

    def holding(self) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
        """What the accounting check adds to the live tables: the blocks each send in flight holds, and those vLLM
        may still hold back (deferred frees: blocks a request released, a block copy's ends)."""
        held = {send.request: list(send.blocks) for send in self.sends.values()}
        maybe: dict[str, list[int]] = {}
        for block, entries in self.released.items():
            for entry in entries:
                maybe.setdefault(entry.request, []).append(block)
        for step, ends in self.retained.items():
            maybe[f"the block copies of step {step} (their ends retained)"] = ends
        return held, maybe

    def before_forward(self, output: Any, worker: Any, step: int) -> None:
        """``start_load_kv``: submit the step's loads (a sync one performed now), after checking each lands in its
        request's blocks; then check the step's reads and writes against the loads in flight."""
        for remote in self.ordered:
            self._check_lands(remote, "is submitted", step)
            if remote.load.asynchronous:
                self._check_uncached(remote, step)
                self.loads[remote.request] = self._failing(
                    attrs.evolve(remote, due=self._due("load", remote.request, step))
                )
            else:
                self.tally.sync_loads += 1
                self._complete(remote, worker, step)
        self.ordered = []
        self._check_step(output, worker, step)

    def after_forward(self, output: Any, worker: Any, step: int) -> Any:
        """``get_finished``: complete the loads due now and report them and the sends due now."""
        from vllm.v1.outputs import KVConnectorOutput

        recving: set[str] = set()
        invalid: set[int] = set()
        failed: set[str] = set()
        for request, remote in sorted(self.loads.items()):
            if remote.due > step:
                continue
            del self.loads[request]
            self._check_lands(remote, "completes", step)
            self._complete(remote, worker, step)
            self.tally.late += int(remote.due > remote.ordered)
            recving.add(request)
            self.received[request] = step
            if remote.whole:
                failed.add(request)
            elif remote.filled is not None:
                invalid.update(remote.blocks[remote.filled :])
            if remote.filled is not None and self.fails_requests:
                self.failed[request] = step
        sending: set[str] = set()
        for request, send in sorted(self.sends.items()):
            if send.due == step:
                sending.add(request)
                self.reported[request] = step
                self.tally.sends += 1
                self.tally.late += int(send.due > send.ordered)
        return KVConnectorOutput(
            finished_recving=recving or None,
            finished_sending=sending or None,
            invalid_block_ids=invalid,
            failed_recving=failed,
        )

    def failing(self, step: int) -> frozenset[str]:
        """The requests step ``step``'s output reports a failed load of, which vLLM's ``fail`` policy finishes with an
        error as it processes that output (none under ``recompute``: their loads are recomputed)."""
        reported = frozenset(request for request, at in self.failed.items() if at <= step)
        for request in reported:
            del self.failed[request]
        return reported

    def collected(self, step: int) -> None:
        """Step ``step``'s output was processed: the sends it reported no longer hold their blocks, the loads it
        reported are the scheduler's to promote, the block copies it ran no longer retain their ends."""
        for copied in [copied for copied in self.retained if copied <= step]:
            del self.retained[copied]
        for request, reported in list(self.received.items()):
            if reported <= step:
                del self.received[request]
        for request, reported in list(self.reported.items()):
            if reported <= step:
                del self.reported[request]
                del self.sends[request]

    # -- transfers -----------------------------------------------------------------------------------------------

    def _due(self, kind: str, request: str, step: int) -> int:
        return step + _draw("delay", kind, request) % (self.max_delay + 1)

    def _failing(self, remote: RemoteLoad) -> RemoteLoad:
        """An async load as it will complete: whole, failed part-way or failed whole (see the module); with several
        KV-cache groups a failure is always whole (vLLM takes them by request only there)."""
        request = remote.request
        if not self.load_failures or _draw("fails", request) % 3:
            return remote
        if _draw("whole", request) % 3 == 0 or len(remote.targets) > 1:
            return attrs.evolve(remote, filled=0, whole=True)
        return attrs.evolve(remote, filled=_draw("filled", request) % len(remote.blocks))

    def _targets(self, load: Any, worker: Any, step: int) -> tuple[tuple[int, ...], ...]:
        """The blocks ``load`` writes, per group (:attr:`RemoteLoad.targets`); a Mamba group's table without a real
        block where the state after the load's last token lives fails the transfer check."""
        size = self.block_size
        targets: list[tuple[int, ...]] = [() for _ in load.tables]
        for rule in worker.groups:
            table = load.tables[rule.index]
            targets[rule.index] = tuple(sorted({table[position // size] for position in range(load.start, load.stop)}))
        entry = worker.mamba.target_entry(load.stop)
        for group in worker.mamba.groups:
            table = load.tables[group]
            if entry >= len(table) or table[entry] == 0:
                raise SchedulerViolation(
                    Check.TRANSFER,
                    step,
                    load.request,
                    f"the remote load of request {load.request}'s positions {load.start}..{load.stop - 1} carries its "
                    f"Mamba state after {load.stop} tokens, which lives in table entry {entry} of Mamba group {group}; "
                    f"but the table vLLM handed the connector there is {list(table)}",
                    "a load's Mamba state without its block",
                )
            targets[group] = (table[entry],)
        return tuple(targets)

    def _complete(self, remote: RemoteLoad, worker: Any, step: int) -> None:
        """Write the remote prefill's K/V of the positions the load fills into their slots in every attention group
        (a failed load's only up to its first failed block: the slots past it are marked as a failed load's, for the
        content check), and the state after its last token into every Mamba group's state block."""
        load = remote.load
        self.tally.loads += 1
        positions = range(load.start, load.stop)
        size = self.block_size
        kv = worker.kv
        unfilled = set(remote.blocks[remote.filled :]) if remote.filled is not None else set()
        self.tally.failed_loads += int(remote.filled is not None)
        for rule in worker.groups:
            namespace = group_namespace(rule.index) + remote.salt
            tags = prefix_tags(namespace, list(load.tokens))
            table = load.tables[rule.index]
            for position in positions:
                slot = table[position // size] * size + position % size
                if slot // size in unfilled:
                    kv.loaded[slot] = False
                    continue
                kv.shadow[slot] = Write(remote.request, position, tags[position], step, namespace)
                kv.loaded[slot] = True
        if remote.filled is None:  # a failed load (whole, on a hybrid: see _failing) carries no state
            worker.mamba.load(remote.request, load.tables, list(load.tokens), remote.salt, step)

    # -- the checks ----------------------------------------------------------------------------------------------

    def _manager_tables(self, request: str) -> Optional[list[list[int]]]:
        """vLLM's own tables for ``request``, one per group (None: the scheduler no longer holds it), read without
        adding one (the managers' ``req_to_blocks`` are defaultdicts)."""
        if request not in self.scheduler.requests:
            return None
        managers = self.scheduler.kv_cache_manager.coordinator.single_type_managers
        return [[block.block_id for block in manager.req_to_blocks.get(request, ())] for manager in managers]

    def _free(self) -> set[int]:
        pool = self.scheduler.kv_cache_manager.block_pool
        return {block.block_id for block in pool.free_block_queue.get_all_free_blocks()}

    def _check_uncached(self, remote: RemoteLoad, step: int) -> None:
        """Every block the async load ``remote`` writes is one vLLM handed the connector as not yet cached: a P2P
        connector (NIXL's) writes a load into those blocks only, so a block with a hash there would be left unwritten
        (or a cached block shared with other requests overwritten)."""
        load = remote.load
        for group, blocks in enumerate(remote.targets):
            unhashed = load.unhashed[group]
            for block in blocks:
                if block in unhashed:
                    continue
                table = load.tables[group]
                positions = [p for p in range(load.start, load.stop) if table[p // self.block_size] == block]
                what = (
                    f"positions {positions[0]}..{positions[-1]}"
                    if positions
                    else f"its Mamba state after {load.stop} tokens"
                ) + ("" if len(remote.targets) == 1 else f" in group {group}")
                raise SchedulerViolation(
                    Check.TRANSFER,
                    step,
                    remote.request,
                    f"the async remote load of request {remote.request}'s positions {load.start}..{load.stop - 1} "
                    f"(ordered at step {remote.ordered}) writes block {block} ({what}), but the blocks vLLM handed "
                    f"the connector as not yet cached there (get_unhashed_block_ids_all_groups, what a P2P connector "
                    f"loads into) are {list(unhashed)}: block {block} carries a block hash, so such a connector "
                    "would not load it",
                    "a load's block with a block hash",
                )

    def _check_lands(self, remote: RemoteLoad, when: str, step: int) -> None:
        """Every block ``remote`` writes is in its request's table (vLLM's own) and not in the free queue."""
        tables = self._manager_tables(remote.request)
        held = set() if tables is None else {block for table in tables for block in table}
        free = self._free()
        for block in remote.blocks:
            if block in held and block not in free:
                continue
            found = (
                f"vLLM no longer holds request {remote.request}"
                if tables is None
                else f"block {block} is in the free queue"
                if block in free
                else f"vLLM's table for {remote.request} is {tables[0]}"
                if len(tables) == 1
                else f"vLLM's tables for {remote.request} are {tables}"
            )
            raise SchedulerViolation(
                Check.TRANSFER,
                step,
                remote.request,
                f"the remote load of request {remote.request}'s positions {remote.load.start}..{remote.load.stop - 1} "
                f"(ordered at step {remote.ordered}) {when} at step {step} and writes block {block}, which the request "
                f"must hold until the load completed; but {found}",
                "a load into a block its request does not hold",
            )

    def _protected(self) -> dict[int, tuple[str, bool]]:
        """The blocks no other owner may take now, each with why (for the message) and whether only a load may not
        (a running request's released block: see :class:`Released`)."""
        why: dict[int, tuple[str, bool]] = {}
        for block, entries in sorted(self.released.items()):
            readers = self.loop.readers.get(block, {})
            for entry in sorted(entries, key=lambda entry: entry.running):  # a deferred free's reason first
                steps = sorted(s for s, requests in readers.items() if entry.request in requests)
                if steps and entry.running:
                    why.setdefault(
                        block,
                        (
                            f"request {entry.request}'s state moved on from it (seen at step {entry.seen}) while step "
                            f"{steps[0]}, which reads it for {entry.request}, is in flight: a later step runs after "
                            "that one on the device, a load does not",
                            True,
                        ),
                    )
                elif steps:
                    why.setdefault(
                        block,
                        (
                            f"request {entry.request} released it (seen at step {entry.seen}) while step {steps[0]}, "
                            f"which reads it for {entry.request}, is in flight: vLLM defers its free until that step's "
                            "output is processed",
                            False,
                        ),
                    )
        for send in self.sends.values():
            for block in send.blocks:
                reason = (
                    f"request {send.request} finished and its send (ordered at step {send.ordered}) has not been "
                    "reported done: the connector delayed its free"
                )
                if why.get(block, ("", True))[1]:
                    why[block] = (reason, False)
        return why

    def _check_protected(self, output: Any, worker: Any, held: dict[str, set[int]], step: int) -> None:
        protected = self._protected()
        if not protected:
            return
        free = self._free()
        for block, (why, loads_only) in sorted(protected.items()):
            taker: Optional[tuple[str, str]] = None
            if block in free and not loads_only:
                taker = ("", "the block is in the free queue")
            for request in sorted(held):
                new = block not in self.last_held.get(request, set())
                if taker is None and new and not loads_only and block in self._beyond_hit(worker, request):
                    taker = (request, f"request {request}'s table takes it beyond its prefix-cache hit")
            for remote in self.ordered:
                if taker is None and block in remote.blocks:
                    taker = (remote.request, f"a load of request {remote.request} into it is ordered")
            if taker is None:
                self.tally.deferred += int("defers" in why)
                continue
            raise SchedulerViolation(
                Check.DELAYED_FREE,
                step,
                taker[0] or None,
                f"block {block} must stay out of {'loads' if loads_only else 'the pool'}: {why}; but at step {step} "
                f"{taker[1]}",
                "a load into a block a step in flight reads"
                if loads_only
                else "a deferred free returned early"
                if "defers" in why
                else "a delayed free returned before its send",
            )

    def _beyond_hit(self, worker: Any, request: str) -> set[int]:
        """The blocks of ``request``'s tables past its prefix-cache hit, by each group's block size: those the prefix
        cache did not hand it (in a Mamba group, of the entries it still holds: align mode's earlier entries may be
        ids of blocks vLLM took back, which the worker's table keeps)."""
        state = worker.requests[request]
        beyond = {
            block
            for rule in worker.groups
            for index, block in enumerate(state.tables[rule.index])
            if (index + 1) * self.block_size > state.hit
        }
        for group in worker.mamba.groups:
            table = state.tables[group]
            held = set(worker.mamba.held_entries(table, state.computed)[0])
            size = worker.mamba.block_size
            beyond.update(
                block for index, block in enumerate(table) if block in held and (index + 1) * size > state.hit
            )
        return beyond

    def _check_step(self, output: Any, worker: Any, step: int) -> None:
        """No block the step writes has a send or an async load in flight; no block it reads has an async load in
        flight."""
        loading = {block: remote for remote in self.loads.values() for block in remote.blocks}
        sending = {block: send for send in self.sends.values() for block in send.blocks}
        if not loading and not sending:
            return
        for request, start, written, read in step_blocks(output, worker, self.block_size):
            for block in sorted(written):
                send = sending.get(block)
                if send is not None:
                    raise SchedulerViolation(
                        Check.DELAYED_FREE,
                        step,
                        request,
                        f"step {step} writes request {request}'s K/V (from position {start}) into block {block}, "
                        f"which request {send.request}'s send (ordered at step {send.ordered}) still reads: its free "
                        "was delayed until the send is reported",
                        "a block written while its send is in flight",
                    )
            for block in sorted(read | written):
                remote = loading.get(block)
                if remote is not None:
                    raise SchedulerViolation(
                        Check.TRANSFER,
                        step,
                        request,
                        f"step {step} schedules request {request} over block {block}, which the remote load of "
                        f"request {remote.request} (ordered at step {remote.ordered}) has not finished writing",
                        "a block used while its load is in flight",
                    )
