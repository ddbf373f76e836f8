"""The Mamba groups of a hybrid model, as kvfuzz's model runner keeps them, and the state each block holds: a
deterministic function of the tokens a request has computed (the tag of its prefix,
:func:`~kvfuzz.reference.content.prefix_tags`, under the group's namespace and the request's cache salt), with who
wrote it. Which table entry a step reads its state from and writes it to is the runner's, per
``mamba_cache_mode`` (one type each):

* ``none`` (:class:`NoneModeStates`): one state block per request, its table's first entry, read and written in
  place (vLLM's Mamba metadata takes the state indices from the block table's first column);
* ``align`` (:class:`AlignModeStates`, vLLM's Mamba prefix caching): a state per block of ``block_size`` tokens; a
  step from ``c`` to ``e`` computed tokens reads the running state from entry ``(c - 1) // block_size`` (the
  runner's pre-copy source) and leaves the state after ``e`` tokens in entry ``(e - 1) // block_size``; an entry
  whose state ends on a block boundary (with partial prefix caching, on any prefix-hash boundary) is a checkpoint
  the prefix cache may hand to another request (a partial one through a block copy,
  :mod:`kvfuzz.scheduler.partial_prefix`).

Invariants the worker holds vLLM to, in every Mamba group:

* **exclusive states**: the block a step writes a request's state to is held by no other live request (an entry of
  any group it still needs: align mode's entries before the running state may be stale ids of blocks vLLM has
  released, which another request may legally get);
* **state**: a request scheduled with ``c > 0`` computed tokens reads the state after exactly its ``c`` tokens: the
  one it wrote itself at its previous step, or (align mode, ``c`` on a block or prefix-hash boundary) a checkpoint
  of the same prefix that the prefix cache handed over;
* **null block**: vLLM's null block 0 is never read nor written as a state (align mode may hand interior entries
  over as null: they are neither)."""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from kvfuzz.reference.content import prefix_tags
from kvfuzz.scheduler.groups import group_namespace
from kvfuzz.scheduler.violations import Check, SchedulerViolation


@attrs.frozen
class StateWrite:
    """What a state block holds: the state of ``request`` after its first ``length`` tokens (``tag``), written at
    ``step``."""

    request: str
    length: int
    tag: int
    step: int


class MambaStates:
    """The state blocks of the Mamba groups ``groups`` (indices in vLLM's ``KVCacheConfig``) and what each holds.
    Subclasses say which entries a step reads and writes."""

    def __init__(self, groups: tuple[int, ...], block_size: int, hash_block_size: int = 0) -> None:
        self.groups = groups
        self.block_size = block_size  # tokens of a Mamba block
        self.hash_block_size = hash_block_size or block_size  # tokens per prefix-cache hash: where a hit may end
        self.states: dict[tuple[int, int], StateWrite] = {}  # (group, block) -> its last state written

    def copy_block(self, source: int, destination: int) -> None:
        """Block ``destination`` takes block ``source``'s state in every Mamba group (a copy-on-write the step runs;
        a block without a state leaves none)."""
        for group in self.groups:
            state = self.states.get((group, source))
            if state is None:
                self.states.pop((group, destination), None)
            else:
                self.states[(group, destination)] = state

    def source_entry(self, computed: int) -> int:
        """The table entry the state after ``computed`` (> 0) tokens is read from."""
        raise NotImplementedError

    def target_entry(self, end: int) -> int:
        """The table entry the state after ``end`` tokens is written to."""
        raise NotImplementedError

    def shared_from(self, computed: int) -> bool:
        """Whether the state after ``computed`` tokens may be another request's (a prefix-cache checkpoint)."""
        return False

    def held_entries(self, table: list[int], computed: int) -> tuple[list[int], list[int]]:
        """The blocks of a live request's table it must hold, and those it may hold or may have released."""
        return [block for block in table if block != 0], []

    def touched(self, tables: list[list[int]], span: range) -> tuple[set[int], set[int]]:
        """The state blocks a step over positions ``span`` reads and writes, across the Mamba groups: it reads the
        running state's block (with ``span.start > 0``) and the one it writes (align mode's pre-copy moves the state
        into it and the step updates it in place; in ``none`` mode the two are one), and writes the latter. Null
        entries and entries past the table are left out (:meth:`step` reports those)."""
        reads: set[int] = set()
        writes: set[int] = set()
        for group in self.groups:
            table = tables[group]
            target = self.target_entry(span.stop)
            entries = [target] + ([self.source_entry(span.start)] if span.start else [])
            reads.update(table[entry] for entry in entries if entry < len(table) and table[entry] != 0)
            if target < len(table) and table[target] != 0:
                writes.add(table[target])
        return reads, writes

    def step(
        self,
        request: str,
        tables: list[list[int]],
        tokens: list[int],
        span: range,
        salt: tuple[str, ...],
        step: int,
        held: dict[str, list[int]],
    ) -> None:
        """A step of ``request`` over positions ``span`` (from ``span.start`` computed tokens to ``span.stop``):
        each Mamba group's state read (checked) and the new state written (its block checked exclusive among the
        blocks live requests ``held`` before the step)."""
        for group in self.groups:
            tags = prefix_tags(group_namespace(group) + salt, tokens[: span.stop])
            if span.start:
                block = self._block(request, group, tables[group], self.source_entry(span.start), "reads", step)
                self._check_read(request, group, block, span.start, tags[span.start - 1], step)
            block = self._block(request, group, tables[group], self.target_entry(span.stop), "writes", step)
            self.check_exclusive(request, group, block, held, step)
            self.states[(group, block)] = StateWrite(request, span.stop, tags[span.stop - 1], step)

    def load(
        self, request: str, tables: tuple[tuple[int, ...], ...], tokens: list[int], salt: tuple[str, ...], step: int
    ) -> None:
        """A connector's load of ``request``'s first ``len(tokens)`` tokens wrote the state after them into each
        Mamba group's block for it (the entry :meth:`target_entry` names; the caller checked it is a real block)."""
        end = len(tokens)
        for group in self.groups:
            tag = prefix_tags(group_namespace(group) + salt, tokens)[end - 1]
            self.states[(group, tables[group][self.target_entry(end)])] = StateWrite(request, end, tag, step)

    def _block(self, request: str, group: int, table: list[int], entry: int, how: str, step: int) -> int:
        if entry >= len(table) or table[entry] == 0:
            raise SchedulerViolation(
                Check.CONTENT,
                step,
                request,
                f"its state block in Mamba group {group} (table entry {entry}) is "
                + ("missing" if entry >= len(table) else "vLLM's null block 0")
                + f" (table {table}), but the step {how} its state there",
                "a Mamba state in the null block" if entry < len(table) else "a Mamba table without its state block",
            )
        return table[entry]

    def check_exclusive(self, request: str, group: int, block: int, held: dict[str, list[int]], step: int) -> None:
        """The block a request's state is written to is held by no other live request (``held``: the blocks of
        every group's entries each still needs), nor twice by this one."""
        for other, blocks in held.items():
            if blocks.count(block) > (other == request):
                raise SchedulerViolation(
                    Check.EXCLUSIVE,
                    step,
                    request,
                    f"its Mamba state block {block} (group {group}) is also a block request {other} still holds: a "
                    "state block belongs to one request",
                    "a shared Mamba state block",
                )

    def _check_read(self, request: str, group: int, block: int, computed: int, tag: int, step: int) -> None:
        found: Optional[StateWrite] = self.states.get((group, block))
        if (
            found is not None
            and (found.request == request or self.shared_from(computed))
            and found.length == computed
            and found.tag == tag
        ):
            return
        holds = (
            "no state written there"
            if found is None
            else f"the state of request {found.request} after {found.length} tokens (tag {found.tag:#x}), written "
            f"at step {found.step}"
        )
        own = "a checkpoint of its prefix" if self.shared_from(computed) else "its own state"
        raise SchedulerViolation(
            Check.CONTENT,
            step,
            request,
            f"it resumes from {computed} computed tokens, so its state block {block} in Mamba group {group} should "
            f"hold {own} after them (tag {tag:#x}), but holds {holds}",
            "a Mamba state not the request's own",
        )


class NoneModeStates(MambaStates):
    """``mamba_cache_mode="none"``: the state lives in the table's first entry, read and written in place."""

    def source_entry(self, computed: int) -> int:
        return 0

    def target_entry(self, end: int) -> int:
        return 0


class AlignModeStates(MambaStates):
    """``mamba_cache_mode="align"``: the state after ``n`` tokens lives in entry ``(n - 1) // block_size``; a state
    ending on a block boundary is a checkpoint another request may read after a prefix-cache hit. Entries before the
    running state's may be nulled or freed by vLLM (``remove_skipped_blocks``) without the worker being told."""

    def source_entry(self, computed: int) -> int:
        return (computed - 1) // self.block_size

    def target_entry(self, end: int) -> int:
        return (end - 1) // self.block_size

    def shared_from(self, computed: int) -> bool:
        return computed % self.hash_block_size == 0

    def held_entries(self, table: list[int], computed: int) -> tuple[list[int], list[int]]:
        kept = max(0, self.source_entry(computed)) if computed else 0
        return [b for b in table[kept:] if b != 0], [b for b in table[:kept] if b != 0]


CheckpointRule = Callable[[int, int], Optional[tuple[int, int]]]
"""Where a step exports a prefill checkpoint: given the sequence length after the step and the tokens it computes,
the checkpoint's position (the state after that many tokens) and the table entry it is written to; None: none."""


class CheckpointingAlignStates(AlignModeStates):
    """Align mode with prefill checkpoints exported from inside the forward pass, as vLLM's Mamba2 mixer does
    (``MambaSpec.num_prefill_checkpoint_blocks``): besides the state after the chunk, a step whose chunk crosses the
    checkpoint position of its sequence (:data:`CheckpointRule`, the runner's rule) writes the state after exactly
    that position into the entry the rule names: on the prompt's last chunk the block vLLM reserved for it, which its
    prefix cache may then hand to another request as a checkpoint of that prefix (so the chunk need not end there);
    on an earlier chunk whatever the table holds there, usually null (the runner then writes vLLM's null block, which
    nothing reads as a state; so is an entry past the table)."""

    def __init__(
        self, groups: tuple[int, ...], block_size: int, hash_block_size: int, checkpoint: CheckpointRule
    ) -> None:
        super().__init__(groups, block_size, hash_block_size)
        self.checkpoint = checkpoint  # the runner's rule: where a step's chunk exports its checkpoint

    def exported(self, tables: list[list[int]], span: range) -> tuple[int, list[tuple[int, int]]]:
        """Where a step over ``span`` exports its checkpoint: the position, and each Mamba group's block for it
        (none where the rule finds no checkpoint; a null entry, or one past the table, is the null block, a scratch
        write nothing reads)."""
        found = self.checkpoint(span.stop, len(span))
        if found is None:
            return 0, []
        position, entry = found
        blocks = [(group, tables[group][entry]) for group in self.groups if entry < len(tables[group])]
        return position, [(group, block) for group, block in blocks if block != 0]

    def touched(self, tables: list[list[int]], span: range) -> tuple[set[int], set[int]]:
        reads, writes = super().touched(tables, span)
        writes.update(block for _, block in self.exported(tables, span)[1])
        return reads, writes

    def step(
        self,
        request: str,
        tables: list[list[int]],
        tokens: list[int],
        span: range,
        salt: tuple[str, ...],
        step: int,
        held: dict[str, list[int]],
    ) -> None:
        super().step(request, tables, tokens, span, salt, step, held)
        position, blocks = self.exported(tables, span)
        for group, block in blocks:
            tags = prefix_tags(group_namespace(group) + salt, tokens[:position])
            self.check_exclusive(request, group, block, held, step)
            self.states[(group, block)] = StateWrite(request, position, tags[position - 1], step)


def mamba_states(
    groups: tuple[int, ...],
    mode: str,
    block_size: int,
    hash_block_size: int = 0,
    checkpoint: Optional[CheckpointRule] = None,
) -> MambaStates:
    """The state model of Mamba groups in ``mode`` (``none`` or ``align``), prefix-cache hits landing every
    ``hash_block_size`` tokens (by default the block size); ``checkpoint``: align mode's prefill checkpoints, exported
    where the rule says (None: the Mamba layers export none)."""
    if checkpoint is not None:
        if mode != "align":
            raise ValueError(f"prefill checkpoints in Mamba mode {mode!r}: vLLM exports them in align mode only")
        return CheckpointingAlignStates(groups, block_size, hash_block_size, checkpoint)
    kinds: dict[str, type[MambaStates]] = {"none": NoneModeStates, "align": AlignModeStates}
    if mode not in kinds:
        raise ValueError(f"Mamba groups in mode {mode!r}, which the worker does not model")
    return kinds[mode](groups, block_size, hash_block_size)
