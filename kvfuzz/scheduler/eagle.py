"""An EAGLE head's draft K/V, and what vLLM's prefix cache promises it (``SchedulerSetup.drafter`` ``eagle`` or
``eagle-drop``).

An EAGLE drafter has attention layers of its own, whose K/V at a position is computed from the target model's hidden
state there *and the next token*: the head's K/V at position ``p`` depends on the tokens up to ``p + 1``. It writes
it into the same blocks as the target's K/V, for every position a step computed, once the step's tokens are known
(the next prompt token for a prefill chunk, the sampled token for the last position). So a block the prefix cache
keeps holds, at its last position, draft K/V computed for the token that followed it in the request that cached it.
A later request whose prompt matches the block but goes on with another token must not be handed that block as the
end of its hit: vLLM's drafter would read draft K/V computed for another continuation. vLLM keeps that promise two
ways: block hashes that cover the token after each block (``num_hash_lookahead_tokens``, its default under prefix
caching: ``eagle``), or, with those off, by dropping the last block of every hit (``use_eagle_block_drop``:
``eagle-drop``).

kvfuzz models the draft K/V as it models the target's (:mod:`kvfuzz.scheduler.kv_slots`): a slot's draft record is
the tag of the writing request's prefix up to the *next* position, under the group's namespace. The check (``prefix
-hit``, :meth:`DraftKV.check`): after the step that admits a request with a prefix-cache hit of ``c`` tokens (new,
or resumed after a preemption) wrote its draft K/V, every position before ``c`` the request's next token attends to
holds draft K/V for the request's own tokens up to the position after it. A stale draft record there (another
continuation's) is a hit the drafter cannot use, however right the target's K/V is; a missing one, a hit on a
position no step computed.

A missed drop costs acceptance, not correctness (the target model verifies every draft): vLLM's option to turn the
drop off (``disable_eagle_block_drop``, "may affect speculative-token acceptance rates") is the trade made knowingly,
and kvfuzz does not draw it."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from kvfuzz.reference.content import TagMemo
from kvfuzz.scheduler.violations import Check, SchedulerViolation


class DraftWrite(NamedTuple):
    """Who last wrote a slot's draft K/V: the request, the position, and the tag of its prefix up to the next
    position (the token after the position included)."""

    request: str
    position: int
    next_tag: int
    step: int


class Admitted(NamedTuple):
    """A request admitted with a prefix-cache hit, its draft K/V to check once the step wrote its own."""

    request: str
    hit: int  # tokens from the prefix cache
    slots: list[int]  # the slot of each position from ``start`` to ``hit - 1`` (the positions it attends)
    start: int  # the first position it attends
    tokens: list[int]  # its tokens (at least ``hit + 1``)
    namespace: tuple[str, ...]  # its K/V namespace in the group


class DraftKV:
    """The draft K/V record of every slot an EAGLE head wrote (absent: never written; the pool's ``drafts``, which its
    copies and a KV connector's transfers move with the slots' own records), and the hits admitted this step,
    checked once the step wrote its draft K/V."""

    def __init__(self, tags: TagMemo, slots: dict[int, DraftWrite]) -> None:
        self.tags = tags  # the pool's prefix tags (shared with the target's K/V)
        self.slots = slots  # slot -> its draft K/V record: the pool's
        self.admitted: list[Admitted] = []

    def write(
        self,
        request: str,
        tokens: list[int],
        positions: range,
        slots: Sequence[int],
        namespace: tuple[str, ...],
        step: int,
    ) -> None:
        """The head's K/V of ``request`` at ``positions`` (computed this step) into ``slots``: ``tokens`` hold the
        token after the last position."""
        if not positions:
            return
        tags = self.tags.tags((request, namespace), namespace, tokens[: positions.stop + 1])
        for position, slot in zip(positions, slots):
            self.slots[slot] = DraftWrite(request, position, tags[position + 1], step)

    def admit(self, admitted: Admitted) -> None:
        """A request scheduled with a prefix-cache hit: checked at :meth:`check_admitted`."""
        if admitted.hit > admitted.start:
            self.admitted.append(admitted)

    def check_admitted(self, step: int) -> None:
        """Every position of each hit admitted this step holds draft K/V for its request's own next token."""
        admitted, self.admitted = self.admitted, []
        for request, hit, slots, start, tokens, namespace in admitted:
            tags = self.tags.tags((request, namespace), namespace, tokens[: hit + 1])
            for position, slot in zip(range(start, hit), slots):
                found = self.slots.get(slot)
                if found is None or found.next_tag != tags[position + 1]:
                    raise SchedulerViolation(
                        Check.PREFIX_HIT,
                        step,
                        request,
                        _stale(position, slot, hit, tokens, found),
                        "a hit on another continuation's draft K/V"
                        if found is not None
                        else "a hit on draft K/V never written",
                    )


def _stale(position: int, slot: int, hit: int, tokens: list[int], found: Optional[DraftWrite]) -> str:
    """The message of a hit position whose draft K/V is not the request's."""
    head = (
        f"it is scheduled with {hit} tokens from the prefix cache, and the EAGLE head reads its draft K/V at "
        f"position {position} (slot {slot}), which must be computed with its next token {tokens[position + 1]}"
    )
    if found is None:
        return f"{head}, but no step wrote draft K/V there"
    return (
        f"{head}, but holds the draft K/V request {found.request} wrote at its position {found.position} at step "
        f"{found.step}, for another continuation: the hit should have stopped before this block (vLLM's lookahead "
        "block hashes, or the EAGLE block drop)"
    )
