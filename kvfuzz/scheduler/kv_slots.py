"""The K/V pool kvfuzz writes as the model of a scheduler target, engine-neutral: slots addressed as the engine
addresses them (``slot // block_size`` is the block or page), the tag-based K/V of a request's own tokens written
there with a shadow record of who wrote it, and the two checks on it:

* **exclusive writes**: a write gives no slot content other than what a claim on it needs (a live request that
  computed that position, or another write of the same step);
* **content**: every position a scheduled token attends to holds the K/V of the request's own tokens up to it."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from kvfuzz.reference.content import TagMemo, kv_for_tags
from kvfuzz.scheduler.config import MODEL_SHAPE
from kvfuzz.scheduler.eagle import DraftWrite
from kvfuzz.scheduler.violations import Check, SchedulerViolation


class Write(NamedTuple):
    """Who last wrote a slot: its shadow record. (A named tuple, immutable as a frozen record and made in a third of
    the time: the worker makes one for every token it writes.)"""

    request: str  # the request whose token was written
    position: int  # the token's position in that request
    tag: int  # the tag of that request's prefix up to the position
    step: int  # the step that wrote it
    namespace: tuple[str, ...] = ()  # that request's K/V namespace (its cache salt, if any)
    draft: bool = False  # the token was a speculative draft, not yet verified when written


class Claim(NamedTuple):
    """Who needs a slot's content this step: a live request that computed the position, or this step's writer. (A
    named tuple, as :class:`Write`: the worker makes one for every position a live request relies on, every step.)"""

    request: str  # the request
    position: int  # its position the slot holds
    tag: int  # the content it needs there
    why: str  # "relies on" or "wrote this step", for the message
    namespace: tuple[str, ...] = ()  # the request's K/V namespace (its cache salt, if any), for the message


class _Relying(NamedTuple):
    """A live request relying on its positions ``start .. len(tokens) - 1`` through a table (:meth:`Claims.rely`)."""

    request: str
    tokens: list[int]  # its tokens up to the last position it relies on
    start: int  # the first position it relies on
    namespace: tuple[str, ...]  # its K/V namespace there


class Claims:
    """Slot -> who needs its content this step: this step's writes so far, else the first live request to rely on a
    position there (shared blocks need the same content, or the content check fails one of them).

    A request relying through a block table is registered block by block and made into a :class:`Claim` only for a
    slot a write touches: a step writes a few slots, while its live requests rely on every position they computed.
    A request relying slot by slot (an engine without block tables, SGLang's token rows) is registered slot by slot;
    a worker registers one way or the other."""

    def __init__(self, block_size: int, tags: TagMemo) -> None:
        self.block_size = block_size  # slots per block
        self.tags = tags  # the pool's prefix tags, for the content a claim needs
        self.written: dict[int, Claim] = {}  # slot -> this step's write there
        self.slots: dict[int, Claim] = {}  # slot -> the first claim registered slot by slot
        # block -> each request relying on a position in it, and the table entry the block is there, in order
        self.blocks: dict[int, list[tuple[_Relying, int]]] = {}

    def rely(self, request: str, tokens: list[int], table: list[int], start: int, namespace: tuple[str, ...]) -> None:
        """``request`` relies on its positions ``start .. len(tokens) - 1``, held by the blocks of ``table`` (each
        entry one that table holds)."""
        if start >= len(tokens):
            return
        relying = _Relying(request, tokens, start, namespace)
        for entry in range(start // self.block_size, (len(tokens) - 1) // self.block_size + 1):
            self.blocks.setdefault(table[entry], []).append((relying, entry))

    def rely_on_slots(
        self, request: str, tokens: list[int], slots: list[int], namespace: tuple[str, ...] = (), start: int = 0
    ) -> None:
        """``request`` relies on its positions ``start .. len(tokens) - 1``, held by ``slots`` (one per position): a
        slot already claimed keeps its first claim."""
        tags = self.tags.tags((request, namespace), namespace, tokens)
        for position, slot in zip(range(start, len(tokens)), slots):
            if slot not in self.slots:
                self.slots[slot] = Claim(request, position, tags[position], "relies on", namespace)

    def get(self, slot: int) -> Optional[Claim]:
        """The claim on ``slot``'s content: this step's write there, else the first live request relying on it."""
        claim = self.written.get(slot)
        if claim is None:
            claim = self.slots.get(slot)
        if claim is not None:
            return claim
        block, offset = divmod(slot, self.block_size)
        for relying, entry in self.blocks.get(block, ()):
            position = entry * self.block_size + offset
            if relying.start <= position < len(relying.tokens):
                tags = self.tags.tags((relying.request, relying.namespace), relying.namespace, relying.tokens)
                return Claim(relying.request, position, tags[position], "relies on", relying.namespace)
        return None


class SlotPool:
    """``slots`` slots, ``block_size`` to a block, and each slot's last write (``None``: never written).

    A slot's K and V are a function of the tag its last write left (:func:`~kvfuzz.reference.content.kv_for_tags`;
    zeros where nothing was written), so the pool keeps the shadow alone: every write, copy and load sets a slot's
    content and its record at once, and the content check compares tags, which is the comparison of K and V bit for
    bit. :meth:`contents` makes the K and V tensors where a kernel reads them."""

    def __init__(self, slots: int, block_size: int) -> None:
        self.block_size = block_size
        self.shadow: list[Optional[Write]] = [None] * slots
        # slots a KV connector's load targeted, until a step writes them: whether the load filled the slot (False:
        # the load failed before its block), for the content check's cause
        self.loaded: dict[int, bool] = {}
        self.tags = TagMemo()  # each (request, namespace)'s prefix tags, extended as its tokens grow
        # slot -> the record of an EAGLE head's draft K/V there (kvfuzz.scheduler.eagle; empty without one): the head's
        # layers live in the same blocks, so every copy and transfer of a slot moves it with the slot's own
        self.drafts: dict[int, DraftWrite] = {}

    def contents(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every slot, ``[slots, layers, kv_heads, head_dim]`` each: the K/V of the tag the slot's last
        write left, zeros where nothing was written (what a model runner's pool holds)."""
        keys = torch.zeros((len(self.shadow), *MODEL_SHAPE.kv_row_shape), dtype=MODEL_SHAPE.dtype)
        values = torch.zeros_like(keys)
        written = [(slot, write.tag) for slot, write in enumerate(self.shadow) if write is not None]
        if written:
            index = torch.tensor([slot for slot, _ in written], dtype=torch.int64)
            keys[index], values[index] = kv_for_tags([tag for _, tag in written], MODEL_SHAPE)
        return keys, values

    def claims(self) -> Claims:
        """No claim yet: a step's, to fill."""
        return Claims(self.block_size, self.tags)

    def write(
        self,
        request: str,
        tokens: list[int],
        positions: range,
        slots: list[int],
        step: int,
        taken: Claims,
        namespace: tuple[str, ...] = (),
        drafts_from: Optional[int] = None,
    ) -> None:
        """Write the K/V of ``tokens``' positions ``positions`` (under ``namespace``, the request's cache salt if any)
        into ``slots``; positions from ``drafts_from`` on hold speculative drafts (recorded as such). A write that
        gives a slot in ``taken`` content other than its claim needs breaks exclusivity; ``taken`` gets a claim for
        every slot written."""
        if not positions:
            return
        tags = self.tags.tags((request, namespace), namespace, tokens[: positions.stop])[positions.start :]
        for slot, position, tag in zip(slots, positions, tags):
            claim = taken.get(slot)
            if claim is not None and claim.tag != tag:
                found = self.shadow[slot]
                raise SchedulerViolation(
                    Check.EXCLUSIVE,
                    step,
                    request,
                    f"its position {position}{salted(namespace)} (tag {tag:#x}) is written to block "
                    f"{slot // self.block_size}, slot {slot}, which request {claim.request} {claim.why} for its "
                    f"position {claim.position}{salted(claim.namespace)} (tag {claim.tag:#x}); the slot holds "
                    + ("nothing yet" if found is None else f"tag {found.tag:#x}, written at step {found.step}"),
                    exclusive_cause(request, position, namespace, claim),
                )
            taken.written[slot] = Claim(request, position, tag, "wrote this step", namespace)
        shadow, loaded = self.shadow, self.loaded
        for slot, position, tag in zip(slots, positions, tags):
            draft = drafts_from is not None and position >= drafts_from
            shadow[slot] = Write(request, position, tag, step, namespace, draft)
            if loaded:
                loaded.pop(slot, None)

    def copy_block(self, source: int, destination: int) -> None:
        """Block ``destination``'s slots take block ``source``'s K/V and shadow (a copy-on-write the step runs)."""
        size = self.block_size
        self.shadow[destination * size : (destination + 1) * size] = self.shadow[source * size : (source + 1) * size]
        for slot in range(destination * size, (destination + 1) * size):
            self.loaded.pop(slot, None)
        if self.drafts:
            self.set_drafts(destination, self.block_drafts(source))

    def block_drafts(self, block: int) -> tuple[Optional[DraftWrite], ...]:
        """Each slot of ``block``'s draft K/V record (None: none written)."""
        return tuple(self.drafts.get(slot) for slot in range(block * self.block_size, (block + 1) * self.block_size))

    def set_drafts(self, block: int, drafts: tuple[Optional[DraftWrite], ...]) -> None:
        """``block``'s slots take ``drafts`` (a copy's or a load's) as their draft K/V records."""
        for slot, draft in zip(range(block * self.block_size, (block + 1) * self.block_size), drafts):
            if draft is None:
                self.drafts.pop(slot, None)
            else:
                self.drafts[slot] = draft

    def check(
        self,
        request: str,
        tokens: list[int],
        slots: list[int],
        step: int,
        namespace: tuple[str, ...] = (),
        start: int = 0,
        hit: int = 0,
    ) -> None:
        """Every position of ``tokens`` from ``start`` on holds, at its slot in ``slots`` (one per such position), the
        K/V of the request's own prefix up to it (under ``namespace``, its cache salt if any). Positions below
        ``hit`` are the ones the request was given from the prefix cache (it never wrote them), for the cause."""
        tags = self.tags.tags((request, namespace), namespace, tokens)
        shadow = self.shadow
        for position, slot in zip(range(start, len(tokens)), slots):
            found = shadow[slot]
            if found is None or found.tag != tags[position]:
                break
        else:
            return
        holds = (
            "nothing written there"
            if found is None
            else f"the K/V of request {found.request}'s {'draft at ' if found.draft else ''}position "
            f"{found.position}{_group_zero(found.namespace, namespace)}{salted(found.namespace)} (tag "
            f"{found.tag:#x}), written at step {found.step}"
        ) + (
            ": a KV connector's load failed before this block and never filled it"
            if self.loaded.get(slot) is False
            else ""
        )
        raise SchedulerViolation(
            Check.CONTENT,
            step,
            request,
            f"position {position} (block {slot // self.block_size}, slot {slot}) should hold the K/V of the "
            f"request's own tokens {tokens[: position + 1]}{salted(namespace)} (tag {tags[position]:#x}), but holds "
            f"{holds}",
            self._content_cause(request, position, tags[position], slot, hit),
        )

    def _content_cause(self, request: str, position: int, tag: int, slot: int, hit: int) -> str:
        """Why ``slot`` does not hold ``request``'s K/V (``tag``) for ``position``, as far as the shadow tells: a cache
        hit on content that differs or was never written (or, where a KV connector's load gave the position, the
        load's content, or the block a failed load never filled), the request's own write gone to another slot, a
        draft's K/V left in place, or content older than the request's write (which never came)."""
        found = self.shadow[slot]
        if position < hit:
            loaded = self.loaded.get(slot)
            if loaded is False:
                return "a block a failed connector load never filled"
            if loaded:
                return "a connector load of other content"
            return "a cache hit on unwritten content" if found is None else "a cache hit on other content"
        if any(
            write is not None and (write.request, write.position, write.tag) == (request, position, tag)
            for other, write in enumerate(self.shadow)
            if other != slot
        ):
            return "its write went to another slot"
        if found is None:
            return "unwritten content"
        if found.draft:
            return "a draft's K/V"
        if found.request == request:
            return "its own K/V of another position"
        return "stale content of another request"


def exclusive_cause(request: str, position: int, namespace: tuple[str, ...], claim: Claim) -> str:
    """The relation between a write (``request``'s ``position`` under ``namespace``) and the claim it breaks: two
    writes of one step, the writer's own computed K/V, a block shared by a cached prefix (the same position in both
    requests) under the same or another cache salt or LoRA adapter, or a block another request holds at another
    position."""
    if claim.why == "wrote this step":
        return "two writes to one slot in a step"
    if claim.request == request:
        return "over its own computed K/V"
    if claim.position != position:
        return "a block another request holds at another position"
    if _parts(claim.namespace).get("lora") != _parts(namespace).get("lora"):
        return "a block shared across LoRA adapters"
    if claim.namespace != namespace:
        return "a block shared across cache salts"
    return "a shared cached prefix block"


GROUP_PREFIX = "kv-cache group "
"""How a namespace's entry naming a KV-cache group begins (the engine's group whose layers hold the K/V); the other
entries are pairs of a kind and a value (a cache salt, a LoRA adapter)."""


def _group_zero(found: tuple[str, ...], expected: tuple[str, ...]) -> str:
    """Where a message sets content found in KV-cache group 0 (whose namespace names no group) beside content
    expected in another group, the words that say so; else nothing."""

    def named(namespace: tuple[str, ...]) -> bool:
        return any(entry.startswith(GROUP_PREFIX) for entry in namespace)

    return f" in {GROUP_PREFIX}0" if named(expected) and not named(found) else ""


def salted(namespace: tuple[str, ...]) -> str:
    """How a message names a K/V namespace: its KV-cache group (group 0 has none), its cache salt and its LoRA
    adapter, or nothing. After the group, a namespace is pairs of a kind and a value (``cache_salt``, ``lora``)."""
    groups = "".join(f" in {entry}" for entry in namespace if entry.startswith(GROUP_PREFIX))
    parts = _parts(namespace)
    return (
        groups
        + (f" under cache salt {parts['cache_salt']!r}" if "cache_salt" in parts else "")
        + (f" under LoRA adapter {parts['lora']}" if "lora" in parts else "")
    )


def _parts(namespace: tuple[str, ...]) -> dict[str, str]:
    """A namespace's parts after its KV-cache group: kind -> value (``cache_salt``, ``lora``)."""
    pairs = [entry for entry in namespace if not entry.startswith(GROUP_PREFIX)]
    return dict(zip(pairs[::2], pairs[1::2]))
