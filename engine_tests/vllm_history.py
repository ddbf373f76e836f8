"""Scheduler-level KV-cache bugs from vLLM v1's history, put back into vLLM 0.33.0 at runtime (the installed package
is never edited): each function takes a ``pytest.MonkeyPatch`` and patches the fix back out, so the scheduler
behaves as it did before the fix until the monkeypatch is undone.

The first two (issue #11562, and one named in the review of its fix) live where the scheduler admits a waiting
request whose prompt hits the prefix cache: ``allocate_slots`` must take a reference on the hit blocks ("touch"
them, which also takes an evictable hit block out of the free queue) and allocate the blocks the rest of the prompt
needs, or refuse the request and leave the pool as it was.

The other two (issues #23347 and #23316) live in priority preemption: a running request that cannot get blocks
preempts the running request of the lowest priority, which may be one the same step has already scheduled; the
step must then take back everything it scheduled for that request. They are rebuilt by recompiling 0.33.0's own
``Scheduler.schedule`` with the lines each fix added taken out again (:func:`_schedule_without`)."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any, Optional, Sequence

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from vllm.v1.core.sched import scheduler as scheduler_module
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager


def touch_before_the_capacity_check(patch: pytest.MonkeyPatch) -> None:
    """vLLM issue #11562, "[Bug]: assert total_num_scheduled_tokens > 0", fixed by pull request #11565, "[Bugfix]
    Move the _touch(computed_blocks) call in the allocate_slots method to after the check for allocating new
    blocks".

    Before the fix, ``allocate_slots`` touched a request's prefix-hit blocks first and checked for enough free
    blocks after; when the check failed it returned None (the scheduler leaves the request waiting) without
    undoing the touch. Each refused admission of a request with a hit leaked one reference on every hit block:
    the blocks stay out of the free queue with a ``ref_cnt`` no request accounts for, and the pool shrinks until
    the engine restarts. The fix touches only once the allocation is sure to succeed.

    Reconstructed on 0.33.0's structure: when ``allocate_slots`` refuses a request that came with hit blocks, the
    touch it would have done before the check is done anyway."""
    original = KVCacheManager.allocate_slots

    def allocate_slots(
        self: KVCacheManager,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        *args: Any,
        **kwargs: Any,
    ) -> Optional[KVCacheBlocks]:
        allocated = original(
            self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, *args, **kwargs
        )
        if allocated is None and new_computed_blocks is not None and self.enable_caching:
            for group in new_computed_blocks.blocks:
                self.block_pool.touch(group)
        return allocated

    patch.setattr(KVCacheManager, "allocate_slots", allocate_slots)


def capacity_check_ignores_evictable_hits(patch: pytest.MonkeyPatch) -> None:
    """The hazard the review of vLLM pull request #11565 named before it merged: once the touch comes after the
    capacity check, the check must count the prefix-hit blocks that are evictable (cached, ``ref_cnt`` 0, in the
    free queue), since touching them takes them out of the free queue the new blocks are drawn from (the review's
    example: 4 blocks needed, 5 free, 2 of them hits). Pull request #11310 ("[V1] Simplify prefix caching logic by
    removing `num_evictable_computed_blocks`") had dropped that count as always zero while the touch came first;
    the pull request's first version moved the touch without counting them again, and the merged code counts them,
    as 0.33.0 does in ``get_num_blocks_to_allocate``. This is a regression caught in review, not one released.

    Without the count the check passes a request whose new blocks fit only if its evictable hits stay free; the
    touch then takes them, and the block pool cannot hand out the new blocks: ``get_new_blocks`` raises in the
    middle of ``schedule()``, which kills the engine core.

    Reconstructed on 0.33.0's structure: the evictable hit blocks are counted as none."""

    def no_evictable_blocks(cls: type, blocks: Sequence[Any]) -> int:
        return 0

    patch.setattr(SingleTypeKVCacheManager, "_get_num_evictable_blocks", classmethod(no_evictable_blocks))


_TAKE_BACK_THE_VICTIM = """\
if preempted_req in scheduled_running_reqs:
    preempted_req_id = preempted_req.request_id
    scheduled_running_reqs.remove(preempted_req)
    restored = num_scheduled_tokens.pop(preempted_req_id)
    token_budget += restored
    input_budget += restored + draft_slots
    req_to_new_blocks.pop(preempted_req_id)
    scheduled_spec_decode_tokens.pop(preempted_req_id, None)
    preempted_encoder_inputs = scheduled_encoder_inputs.pop(
        preempted_req_id, None
    )
    if preempted_encoder_inputs:
        # Restore encoder compute budget if the preempted
        # request had encoder inputs scheduled in this step.
        num_embeds_to_restore = sum(
            preempted_req.get_num_encoder_embeds(i)
            for i in preempted_encoder_inputs
        )
        encoder_compute_budget += num_embeds_to_restore
"""
"""0.33.0's ``schedule()``: what the step takes back from a victim of priority preemption it had already scheduled:
its place among the scheduled running requests, its scheduled tokens (given back to the budget), its new blocks,
its drafts and its encoder inputs (the last two added after both fixes, for speculative decoding and multimodal
inputs, which the target does not drive)."""


def _schedule_without(patch: pytest.MonkeyPatch, fixed: str, before: str, assertions: bool = True) -> None:
    """Replace ``Scheduler.schedule`` by 0.33.0's own source with the lines ``fixed`` (written unindented, found at
    whatever indentation they have in the method) replaced by ``before``, compiled in the scheduler module's
    namespace (without its ``assert`` statements, as ``python -O`` compiles it, unless ``assertions``). Raises
    ``RuntimeError`` where the installed source no longer has ``fixed``."""
    lines, first_line = inspect.getsourcelines(Scheduler.schedule)
    source = textwrap.dedent("".join(lines))
    first = fixed.splitlines()[0]
    # ``before`` padded with empty lines to the length of ``fixed``, and the method compiled at its line in the file,
    # so that a traceback through the patched method names the installed file's lines and their text.
    padded = before + "\n" * (fixed.count("\n") - before.count("\n"))
    for line in source.splitlines(keepends=True):
        indent = line[: len(line) - len(line.lstrip())]
        if line.strip() == first and textwrap.indent(fixed, indent) in source:
            rewritten = source.replace(textwrap.indent(fixed, indent), textwrap.indent(padded, indent), 1)
            break
    else:
        raise RuntimeError("the installed vLLM's Scheduler.schedule does not have the lines the fix added")
    namespace: dict[str, Any] = {}
    rewritten = "\n" * (first_line - 1) + rewritten
    code = compile(
        rewritten, inspect.getsourcefile(Scheduler) or "scheduler.py", "exec", optimize=-1 if assertions else 1
    )
    exec(code, vars(scheduler_module), namespace)
    patch.setattr(Scheduler, "schedule", namespace["schedule"])


def priority_victim_stays_scheduled(patch: pytest.MonkeyPatch, assertions: bool = True) -> None:
    """vLLM issue #23347, "[Bug]: V1 priority scheduling crashes at preemption", fixed by pull request #23713,
    "[Bugfix] Fix for V1 priority scheduling crashes at preemption" (August 2025).

    Under the priority policy the running loop schedules requests in the order of ``self.running``; when one
    cannot get blocks, the scheduler preempts the running request of the lowest priority, which may be one it has
    already scheduled in the same step. Before the fix the victim was removed from ``self.running`` and preempted
    (its blocks freed, its computed tokens reset), but stayed in the step's ``scheduled_running_reqs``, its
    ``num_scheduled_tokens`` and its new blocks: the output schedules, as a running request, a request that the
    same output preempts. The issue's report is the scheduler's own assertion that the scheduled requests are no
    more than the running ones (``scheduled_running_reqs: 2 > running: 1``); where other running requests went
    unscheduled, the assertion holds and the output goes to the model runner. The fix removes the victim from
    ``scheduled_running_reqs``.

    Reconstructed on 0.33.0: ``schedule()`` without the block that takes the victim back (which #23713 began and
    #26661 completed); 0.33.0's index bookkeeping for the removed entry is kept. Without ``assertions`` the
    method is compiled as ``python -O`` would compile it: the scheduler's assertion is gone, and the output goes
    to the model runner."""
    _schedule_without(patch, _TAKE_BACK_THE_VICTIM, "", assertions)


def priority_victim_keeps_its_tokens(patch: pytest.MonkeyPatch) -> None:
    """vLLM issue #23316 (a block-table index out of range under priority scheduling), fixed by pull request
    #26661, "[Bugfix][Core]Fix block table out-of-range issue in priority scheduling" (October 2025).

    After #23713 the victim of priority preemption left ``scheduled_running_reqs``, but, as the pull request
    says, its entries in ``num_scheduled_tokens`` and ``req_to_new_blocks`` stayed (and the token budget it had
    taken was not given back): the output schedules tokens for a request it brings neither as new nor as cached,
    which the model runner has no table row for, and ``_update_after_schedule`` advances the preempted request's
    computed tokens past 0, so that it is later resumed as if positions it never recomputed were computed. The fix
    pops both entries and restores the budget.

    Reconstructed on 0.33.0: ``schedule()`` whose take-back removes the victim from ``scheduled_running_reqs``
    only (the pull request's description of the code before it; its diff was not available where this was
    written)."""
    _schedule_without(patch, _TAKE_BACK_THE_VICTIM, _REMOVE_THE_VICTIM_ONLY)


_REMOVE_THE_VICTIM_ONLY = """\
if preempted_req in scheduled_running_reqs:
    scheduled_running_reqs.remove(preempted_req)
"""
"""The take-back as pull request #23713 left it."""
