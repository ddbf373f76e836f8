"""The client's prefix-cache resets (``SchedulerSetup.prefix_resets``): vLLM's ``Scheduler.reset_prefix_cache``, as an
RLHF trainer calls it after it updates the model's weights, and what it promises.

* Without ``reset_running_requests`` it refuses (returns false) while any block is in use, leaving the prefix cache as
  it was; with no block in use it succeeds. With it, every running request is preempted first, and it succeeds,
  unless a request waits for a KV connector's load: vLLM then raises RuntimeError, its stated limit ("not supported
  yet"), counted here as a refusal; raised with no load in flight, it is a crash finding.
* With a KV connector (vLLM's offloading connector) every reset asks for the connector's store to be reset too
  (``reset_connector``, as the engine's weight-update path does), so nothing the connector stored before a
  successful reset is loaded after it.
* Where it succeeds, no block is cached after it, and no later hit is served from before it.

The last two are checked through the content check: kvfuzz models a reset as new weights, so the K/V every request
computes after a successful reset is tagged under a new epoch of its namespace (:meth:`PrefixResets.namespace`). A reset
succeeds only with no block in use, so every request recomputes all of its K/V after it, unless the prefix cache hands
it a block computed before the reset: that block holds the old epoch's K/V, and the content check names it when the
request attends to it; so does a load of what the connector stored before it. The first is checked here, right after the
call (:meth:`PrefixResets.reset`): a refusal while no block is in use, a success while blocks are (without preemption),
a refusal that changed the cache, a success that left a block cached. "In use" is read from the blocks' reference
counts, not from the pool's free count vLLM's own test uses."""

from __future__ import annotations

from typing import Any

from kvfuzz.scheduler.violations import Check, SchedulerViolation


def cached_blocks(pool: Any) -> dict[int, Any]:
    """Block id -> its prefix-cache hash, for every block of ``pool`` that has one."""
    return {block.block_id: block.block_hash for block in pool.blocks if block.block_hash is not None}


def loading(scheduler: Any) -> list[str]:
    """The requests waiting for a KV connector's load (``WAITING_FOR_REMOTE_KVS``): they hold blocks a preempting
    reset cannot free, and vLLM raises rather than reset while one does ("not supported yet")."""
    return [
        request_id
        for request_id, request in scheduler.requests.items()
        if request.status.name == "WAITING_FOR_REMOTE_KVS"
    ]


def used_blocks(pool: Any) -> list[int]:
    """The blocks of ``pool`` some request holds (reference count above 0), vLLM's null block left out."""
    return [block.block_id for block in pool.blocks if block.ref_cnt > 0 and not block.is_null]


class PrefixResets:
    """One example's resets: the epoch of the K/V namespace (successful resets so far), each request's namespace
    before it (its cache salt's and LoRA adapter's part), and the resets that succeeded and were refused."""

    def __init__(self) -> None:
        self.epoch = 0  # successful resets so far: the weights' version
        self.bases: dict[str, tuple[str, ...]] = {}  # request -> its namespace without the epoch
        self.refused = 0  # resets vLLM refused (blocks were in use)

    def namespace(self, request: str, base: tuple[str, ...]) -> tuple[str, ...]:
        """The K/V namespace of ``request`` (``base``: its salt's and adapter's part) under the current epoch: ``base``
        alone before any reset, so that an example without one tags its K/V as it always did."""
        self.bases[request] = base
        return base + (("weights", str(self.epoch)) if self.epoch else ())

    def resets_connector(self, scheduler: Any) -> bool:
        """Whether this reset asks vLLM to reset the KV connector's own store too (``reset_connector``): always with a
        connector (new weights make what it stored stale, as they do the prefix cache), and every other reset
        without one (where vLLM treats it as a no-op that succeeds), so both of vLLM's paths run."""
        return scheduler.connector is not None or (self.epoch + self.refused) % 2 == 1

    def reset(self, scheduler: Any, worker: Any, preempt: bool, step: int) -> bool:
        """Call ``scheduler.reset_prefix_cache`` (``preempt``: ``reset_running_requests``) and check what it promises
        (the module's docstring); on success, move every request ``worker`` holds to the new epoch. Returns whether
        it reset."""
        pool = scheduler.kv_cache_manager.block_pool
        used = used_blocks(pool)
        before = cached_blocks(pool)
        try:
            done = bool(
                scheduler.reset_prefix_cache(
                    reset_running_requests=preempt, reset_connector=self.resets_connector(scheduler)
                )
            )
        except RuntimeError:
            if not (preempt and loading(scheduler)):
                raise
            self.refused += 1  # vLLM's stated limit: a preempting reset while a KV load is in flight raises
            return False
        after = cached_blocks(pool)
        if not done:
            self.refused += 1
            if not used:
                raise SchedulerViolation(
                    Check.PREFIX_RESET,
                    step,
                    None,
                    "reset_prefix_cache() refused with no block in use (every block's reference count is 0)",
                    "a reset refused while idle",
                )
            if after != before:
                changed = sorted(set(before.items()) ^ set(after.items()))
                raise SchedulerViolation(
                    Check.PREFIX_RESET,
                    step,
                    None,
                    f"reset_prefix_cache() refused (blocks {used} in use), but the prefix cache changed: block(s) "
                    f"{sorted({block for block, _ in changed})} gained or lost their hash",
                    "a refused reset that changed the cache",
                )
            return False
        if used and not preempt:
            raise SchedulerViolation(
                Check.PREFIX_RESET,
                step,
                None,
                f"reset_prefix_cache() succeeded while block(s) {used} were in use: it must refuse until they are "
                "freed",
                "a reset while blocks are in use",
            )
        if after or len(pool.cached_block_hash_to_block):
            raise SchedulerViolation(
                Check.PREFIX_RESET,
                step,
                None,
                f"reset_prefix_cache() succeeded, but block(s) {sorted(after)} keep a hash and the cache maps "
                f"{len(pool.cached_block_hash_to_block)} hash(es): a later request could hit K/V from before it",
                "blocks still cached after a reset",
            )
        self.epoch += 1
        for request, base in self.bases.items():
            namespace = self.namespace(request, base)
            if request in worker.namespaces:
                worker.namespaces[request] = namespace
            if request in worker.requests:
                worker.requests[request].namespace = namespace
        return True
