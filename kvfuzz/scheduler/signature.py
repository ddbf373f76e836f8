"""What makes two failures of a scheduler target one finding: its signature.

A signature (:class:`~kvfuzz.shrink.signature.Signature`, the allocator target's) names the scheduler, the check
(``crash (TYPE)`` for an exception of the engine's own) and what is known of the cause: the cause the check named
where it names one (``accounting: a held block's ref_cnt``), and for a crash the innermost frame outside kvfuzz's
harness and the standard library (``crash (ValueError) at vllm.v1.core.block_pool.BlockPool.get_new_blocks``). The
step, the request and the block never enter it: the same bug met in another example is the same finding.
"""

from __future__ import annotations

from kvfuzz.scheduler.violations import SchedulerViolation
from kvfuzz.shrink.signature import Signature, allocator_frame


def scheduler_signature(scheduler: str, failure: BaseException) -> Signature:
    """The signature of ``failure``: the check and its cause, or a crash's type and frame."""
    if isinstance(failure, SchedulerViolation):
        return Signature(scheduler, failure.check.value, None, cause=failure.cause)
    return Signature(scheduler, f"crash ({type(failure).__name__})", None, allocator_frame(failure))
