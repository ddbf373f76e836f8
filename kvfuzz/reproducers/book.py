"""The part every allocator reproducer shares (:mod:`kvfuzz.reproducers`): Python source, copied verbatim into the
reproducer, that keeps the reproducer's own account of which K/V each slot of the engine's pool holds, read off the
block tables the engine hands out, and states kvfuzz's cache-soundness and content checks on it.

The account is kvfuzz's model of an engine, reduced to what those two checks need: the K/V at position ``p`` of a
request is determined by its key (its namespace: cache salt, LoRA adapter, extra key) and its tokens ``0 .. p``; a
step writes every position a running request was scheduled to compute since the previous step, into the slot its
table held then, and nothing else writes. A preemption withdraws the request's scheduled writes (the step never
computes them); a free (abort) lands them where the engine runs a scheduled step in full. A cache hit is sound when
every position it counts as computed holds the request's own K/V, written by a completed step or scheduled by a live
request for the next one."""

from __future__ import annotations

BOOK = r'''
# ---- the reproducer's account of the K/V each slot holds (the same in every allocator reproducer) -----------------
class Failure(AssertionError):
    """A promise of the KV cache broken, stated on the block tables the engine handed out."""


class Book:
    """Which K/V each slot (block, offset) holds, from the tables the engine hands out. The K/V at position p of a
    request is that of (its key, its tokens 0..p); step() writes what was scheduled since the previous step."""

    def __init__(self, block_size, lands_on_free, unit="block"):
        self.block_size = block_size
        self.unit = unit  # what the engine calls a block
        self.lands_on_free = lands_on_free  # a freed (aborted) request's scheduled writes still land at the next step
        self.step = 0  # steps completed so far: the step being scheduled
        self.written = {}  # slot -> (request, content, step that wrote it)
        self.scheduled = {}  # request -> [(slot, content, position)] the next step writes
        self.hits = {}  # request -> {(slot, position)}: hit positions only a scheduled write fills
        self.copies = []  # (source block, destination block) the next step copies before it writes

    def content(self, key, tokens, position):
        return (key, tuple(tokens[: position + 1]))

    def describe(self, slot):
        block, offset = slot
        return f"{self.unit} {block} offset {offset}"

    def holds(self, slot):
        """What the slot holds, in words."""
        found = self.written.get(slot)
        if found is None:
            return "nothing: no step has written it"
        request, (key, prefix), step = found
        where = f"{request}'s position {len(prefix) - 1} (key {key!r}, tokens {list(prefix)})"
        return f"K/V of {where}, written by step {step}"

    def hit(self, request, key, tokens, slots, cached):
        """The engine counts request's first `cached` positions as computed, at `slots` (one per position)."""
        for position in range(cached):
            slot, wanted = slots[position], self.content(key, tokens, position)
            found = self.written.get(slot)
            if found is not None and found[1] == wanted:
                continue
            writers = [r for r, writes in self.scheduled.items() for s, c, _ in writes if s == slot and c == wanted]
            if writers:
                self.hits.setdefault(request, set()).add((slot, position))
                continue
            raise Failure(
                f"cache soundness at step {self.step}: the cache hit of {cached} tokens for {request} covers its "
                f"position {position} with {self.describe(slot)}, which holds {self.holds(slot)}, and no live request "
                f"is scheduled to write it; expected: K/V of key {key!r}, tokens {list(tokens[: position + 1])}"
            )

    def schedule(self, request, key, tokens, slots, first):
        """request's positions first.. of `tokens` are scheduled: the next step writes them at `slots`."""
        self.scheduled.setdefault(request, []).extend(
            (slots[position], self.content(key, tokens, position), position) for position in range(first, len(tokens))
        )

    def withdraw(self, request, why):
        """request leaves the step it was scheduled in: its scheduled writes never happen."""
        for slot, _, position in self.scheduled.pop(request, []):
            for other, covered in self.hits.items():
                if other != request and any(s == slot for s, _ in covered):
                    raise Failure(
                        f"cache soundness at step {self.step}: {why} withdraws {request}'s scheduled write of its "
                        f"position {position} into {self.describe(slot)}, which {other}'s cache hit counts as "
                        "computed: no step will write it"
                    )
        self.hits.pop(request, None)

    def freed(self, request):
        if not self.lands_on_free:
            self.withdraw(request, f"freeing {request}")
        self.hits.pop(request, None)

    def copy(self, pairs):
        """Block copies (copy-on-write) the next step performs before its writes."""
        self.copies.extend(pairs)

    def move(self, pairs):
        """Blocks copied now (a swap): each destination holds what its source held."""
        moved = {}
        for source, destination in pairs:
            for offset in range(self.block_size):
                if (source, offset) in self.written:
                    moved[(destination, offset)] = self.written[(source, offset)]
                else:
                    moved[(destination, offset)] = None
        for slot, found in moved.items():
            if found is None:
                self.written.pop(slot, None)
            else:
                self.written[slot] = found

    def completed(self):
        """The step ran: the ordered copies, then every scheduled write, land."""
        self.move(self.copies)
        self.copies = []
        for request, writes in self.scheduled.items():
            for slot, content, _ in writes:
                self.written[slot] = (request, content, self.step)
        self.scheduled, self.hits = {}, {}
        self.step += 1

    def check_contents(self, tables):
        """After a step, each running request's computed positions hold its own K/V. `tables`: request -> (key,
        tokens, slots of its computed positions)."""
        for request, (key, tokens, slots) in sorted(tables.items()):
            for position, slot in enumerate(slots):
                found = self.written.get(slot)
                if found is None or found[1] != self.content(key, tokens, position):
                    raise Failure(
                        f"content after step {self.step - 1}: {request}'s position {position} is in "
                        f"{self.describe(slot)}, which holds {self.holds(slot)}; expected: K/V of key {key!r}, "
                        f"tokens {list(tokens[: position + 1])}"
                    )
'''
