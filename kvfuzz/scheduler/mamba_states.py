"""The Mamba groups of a hybrid model, as kvfuzz's model runner keeps them: one state block per request and group
(``mamba_cache_mode="none"``: the state is read from and written back to the block in entry 0 of the request's
table in that group, as vLLM's Mamba attention metadata takes its state indices from the block table's first
column), and the state each block holds: a deterministic function of the tokens the request has computed (the tag
of its prefix, :func:`~kvfuzz.reference.content.prefix_tags`, under the group's namespace and the request's cache
salt), with who wrote it.

Invariants the worker holds vLLM to, in every Mamba group:

* **exclusive states**: a live request's state block is in no other live request's table, of any group;
* **state**: a request scheduled with ``c > 0`` computed tokens reads, from its state block, the state it wrote
  itself after exactly those ``c`` tokens at its previous step (a request with none computed starts from a fresh
  state and reads nothing); after the step its block holds the state after its new computed tokens;
* **null block**: vLLM's null block 0 is never a request's state block, so never written nor read as a state."""

from __future__ import annotations

from typing import Optional

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
    """The state blocks of the Mamba groups ``groups`` (indices in vLLM's ``KVCacheConfig``) and what each holds."""

    def __init__(self, groups: tuple[int, ...]) -> None:
        self.groups = groups
        self.states: dict[tuple[int, int], StateWrite] = {}  # (group, block) -> its last state written

    def state_block(self, request: str, group: int, table: list[int], step: int) -> int:
        """The block a request's state lives in, in ``group``: its table's first entry, which must be a real block."""
        if not table or table[0] == 0:
            raise SchedulerViolation(
                Check.CONTENT,
                step,
                request,
                f"its state block in Mamba group {group} is "
                + ("missing (empty table)" if not table else f"vLLM's null block 0 (table {table})")
                + ", but the step reads and writes its state there",
                "a Mamba state in the null block" if table else "a Mamba table without a state block",
            )
        return table[0]

    def check_exclusive(self, live: dict[str, list[list[int]]], step: int) -> None:
        """No live request's state block is in another live request's table (of any group)."""
        owners: dict[int, list[tuple[str, int]]] = {}
        for request, tables in live.items():
            for group, table in enumerate(tables):
                for block in set(table) - {0}:
                    owners.setdefault(block, []).append((request, group))
        for request, tables in live.items():
            for group in self.groups:
                if not tables[group] or tables[group][0] == 0:
                    continue
                others = [owner for owner in owners[tables[group][0]] if owner != (request, group)]
                if others:
                    other, other_group = others[0]
                    raise SchedulerViolation(
                        Check.EXCLUSIVE,
                        step,
                        request,
                        f"its Mamba state block {tables[group][0]} (group {group}) is also in the table of request "
                        f"{other} (group {other_group}): a state block belongs to one request",
                        "a shared Mamba state block",
                    )

    def step(
        self,
        request: str,
        tables: list[list[int]],
        tokens: list[int],
        computed: int,
        end: int,
        salt: tuple[str, ...],
        step: int,
    ) -> None:
        """A step of ``request`` from ``computed`` to ``end`` tokens: each Mamba group's state read (checked) and
        the new state written."""
        for group in self.groups:
            block = self.state_block(request, group, tables[group], step)
            tags = prefix_tags(group_namespace(group) + salt, tokens[:end])
            if computed:
                self._check_read(request, group, block, computed, tags[computed - 1], step)
            self.states[(group, block)] = StateWrite(request, end, tags[end - 1], step)

    def _check_read(self, request: str, group: int, block: int, computed: int, tag: int, step: int) -> None:
        found: Optional[StateWrite] = self.states.get((group, block))
        if found is not None and found.request == request and found.length == computed and found.tag == tag:
            return
        holds = (
            "no state written there"
            if found is None
            else f"the state of request {found.request} after {found.length} tokens (tag {found.tag:#x}), written "
            f"at step {found.step}"
        )
        raise SchedulerViolation(
            Check.CONTENT,
            step,
            request,
            f"it resumes from {computed} computed tokens, so its state block {block} in Mamba group {group} should "
            f"hold its own state after them (tag {tag:#x}), but holds {holds}",
            "a Mamba state not the request's own",
        )
