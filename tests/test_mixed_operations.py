"""``kvfuzz.allocator.PagedAllocator`` under mixed operations: the counts identity after a hand-written
sequence, and a small seeded random driver checking content, exclusive writes, the window and refusals.
"""

from __future__ import annotations

import random

import pytest
from factories import B, check_counts, make, snapshot, toks

from kvfuzz.allocator import OutOfBlocks, PagedAllocator, Slot

# -- the counts identity over mixed operations -----------------------------------------------------------------------


def test_counts_identity_after_a_mixed_sequence_of_operations() -> None:
    a = make(10, window=1, host=4)
    running: dict[str, int] = {}

    def step(n: int) -> None:
        a.step_completed(n)
        check_counts(a, running)

    a.admit("a", (), toks(0, 2 * B + 1))
    running["a"] = 2 * B + 1
    check_counts(a, running)
    a.admit("b", ("x",), toks(0, B))
    running["b"] = B
    check_counts(a, running)
    step(0)
    step(1)
    a.fork("a", "a2")
    running["a2"] = running["a"]
    check_counts(a, running)
    a.grow("a2", (5, 6))
    running["a2"] += 2
    check_counts(a, running)
    a.admit("c", (), toks(0, 2 * B + 3))
    running["c"] = 2 * B + 3
    check_counts(a, running)
    a.rollback("a", B + 2)
    running["a"] -= B + 2
    check_counts(a, running)
    a.swap_out("b")
    del running["b"]
    check_counts(a, running)
    step(2)
    a.free("c")
    del running["c"]
    check_counts(a, running)
    a.preempt("a2")
    del running["a2"]
    check_counts(a, running)
    a.swap_in("b")
    running["b"] = B
    check_counts(a, running)
    a.evict(1)
    check_counts(a, running)
    step(3)
    a.grow("a", toks(40, 3 * B))
    running["a"] += 3 * B
    check_counts(a, running)
    with pytest.raises(OutOfBlocks):
        a.admit("huge", (), toks(0, 20 * B))
    check_counts(a, running)
    a.reset_cache()
    check_counts(a, running)
    for seq in list(running):
        a.free(seq)
        del running[seq]
        check_counts(a, running)
    step(4)
    step(5)
    a.reset_cache()
    assert sorted(a.free_blocks()) == list(range(10)), "quiescence: every block free"


# -- a small seeded random driver: content, exclusive writes, window, atomic refusals --------------------------------


class _Driver:
    """Plays a simple engine against the allocator with writes applied at once, checking after every call:
    the content of every position of every running sequence (a shadow of (namespace, prefix) per slot), that every
    write goes to a block referenced once, that no block is written before its release window closed, that refusals
    change nothing, and the counts identity."""

    NAMESPACES = [(), ("a",), ("ab", "c"), ("a", "bc")]
    PROMPTS = [toks(0, 2 * B), toks(0, B) + toks(50, B), toks(100, 3 * B)]

    def __init__(self, a: PagedAllocator, rng: random.Random) -> None:
        self.a, self.rng = a, rng
        self.window = a.capabilities.inflight_window
        self.seqs: dict[str, tuple] = {}  # running: (namespace, tokens)
        self.swapped: dict[str, tuple] = {}  # (namespace, tokens, host blocks)
        self.shadow: dict[tuple[int, int], tuple] = {}
        self.host_shadow: dict[tuple[int, int], tuple] = {}
        self.released_at: dict[int, int] = {}
        self.last = -1
        self.counter = 0
        self.stats = {"hits": 0, "copies": 0, "refusals": 0}

    # writes -------------------------------------------------------------------------------------------------------

    def write(self, seq: str, block: int, offset: int, value: tuple) -> None:
        a = self.a
        assert a.refcount(block) == 1, f"{seq} writes to block {block} held {a.refcount(block)} times"
        if block in self.released_at:
            assert self.last >= self.released_at[block] + self.window, (
                f"block {block} released after step {self.released_at[block]} written after step {self.last}"
            )
        self.shadow[(block, offset)] = value

    def write_positions(self, seq: str, start: int) -> None:
        namespace, tokens = self.seqs[seq]
        table = self.a.block_table(seq)
        for p in range(start, len(tokens)):
            self.write(seq, table[p // B], p % B, (namespace, tokens[: p + 1]))

    def copy_block(self, src: int, dst: int, shadow_src: dict, shadow_dst: dict) -> None:
        for offset in range(B):
            if (src, offset) in shadow_src:
                shadow_dst[(dst, offset)] = shadow_src[(src, offset)]
            else:
                shadow_dst.pop((dst, offset), None)

    # checks -------------------------------------------------------------------------------------------------------

    def check(self) -> None:
        check_counts(self.a, {seq: len(tokens) for seq, (_, tokens) in self.seqs.items()})
        for seq, (namespace, tokens) in self.seqs.items():
            table = self.a.block_table(seq)
            for p in range(len(tokens)):
                got = self.shadow.get((table[p // B], p % B))
                assert got == (namespace, tokens[: p + 1]), f"{seq} position {p} holds {got}"

    # operations -----------------------------------------------------------------------------------------------------

    def op(self) -> None:
        a, rng = self.a, self.rng
        weights = {
            "admit": 4,
            "grow": 3,
            "step": 3,
            "free": 2,
            "fork": 1.5,
            "rollback": 1,
            "preempt": 1,
            "swap_out": 1,
            "swap_in": 1,
            "evict": 0.5,
            "reset": 0.2,
        }
        (kind,) = rng.choices(list(weights), weights=list(weights.values()))
        running = sorted(self.seqs)
        before = snapshot(a, running + sorted(self.swapped))
        refs_before = [a.refcount(b) for b in range(a.num_blocks)]
        try:
            self.apply(kind, running)
        except OutOfBlocks:
            self.stats["refusals"] += 1
            assert snapshot(a, running + sorted(self.swapped)) == before
        for b in range(a.num_blocks):
            if refs_before[b] > 0 and a.refcount(b) == 0:
                self.released_at[b] = self.last
        self.check()

    def apply(self, kind: str, running: list[str]) -> None:
        a, rng = self.a, self.rng
        if kind == "admit":
            seq = f"s{self.counter}"
            self.counter += 1
            namespace = rng.choice(self.NAMESPACES)
            cut = rng.choice([B, 2 * B, 3 * B, rng.randint(1, 3 * B)])
            tokens = rng.choice(self.PROMPTS)[:cut] + toks(1000, rng.randint(0, B + 1))
            result = a.admit(seq, namespace, tokens)
            assert result.num_cached_tokens % B == 0 and result.num_cached_tokens <= len(tokens)
            assert len(result.block_table) == -(-len(tokens) // B)
            self.stats["hits"] += result.num_cached_tokens
            self.seqs[seq] = (namespace, tokens)
            self.write_positions(seq, result.num_cached_tokens)
        elif kind == "grow" and running:
            seq = rng.choice(running)
            namespace, tokens = self.seqs[seq]
            if len(tokens) > 4 * B:  # keep sequences short so that the pool turns over
                a.free(seq)
                del self.seqs[seq]
                return
            new = tuple(rng.randint(0, 3) for _ in range(rng.randint(1, B + 2)))
            result = a.grow(seq, new)
            for cow in result.copies:
                self.copy_block(cow.src, cow.dst, self.shadow, self.shadow)
                self.stats["copies"] += 1
            self.seqs[seq] = (namespace, tokens + new)
            table = a.block_table(seq)
            assert result.slots == tuple(Slot(table[p // B], p % B) for p in range(len(tokens), len(tokens) + len(new)))
            for cow in result.copies:
                assert a.refcount(cow.dst) == 1 and cow.dst in table
            self.write_positions(seq, len(tokens))
        elif kind == "step":
            self.last += 1
            a.step_completed(self.last)
        elif kind == "free" and (running or self.swapped):
            seq = rng.choice(running + sorted(self.swapped))
            a.free(seq)
            self.seqs.pop(seq, None)
            self.swapped.pop(seq, None)
        elif kind == "preempt" and running:
            seq = rng.choice(running)
            a.preempt(seq)
            del self.seqs[seq]
        elif kind == "fork" and running:
            parent = rng.choice(running)
            child = f"s{self.counter}"
            self.counter += 1
            a.fork(parent, child)
            self.seqs[child] = self.seqs[parent]
            assert a.block_table(child) == a.block_table(parent)
        elif kind == "rollback" and running:
            seq = rng.choice(running)
            namespace, tokens = self.seqs[seq]
            if len(tokens) > 1:
                k = rng.randint(1, min(len(tokens) - 1, B + 2))
                a.rollback(seq, k)
                self.seqs[seq] = (namespace, tokens[:-k])
        elif kind == "swap_out" and running:
            seq = rng.choice(running)
            table = a.block_table(seq)
            result = a.swap_out(seq)
            assert tuple(d for d, _ in result.mapping) == tuple(table)
            assert len({h for _, h in result.mapping}) == len(table)
            for device, host in result.mapping:
                self.copy_block(device, host, self.shadow, self.host_shadow)
            namespace, tokens = self.seqs.pop(seq)
            self.swapped[seq] = (namespace, tokens, [h for _, h in result.mapping])
        elif kind == "swap_in" and self.swapped:
            seq = rng.choice(sorted(self.swapped))
            namespace, tokens, hosts = self.swapped[seq]
            result = a.swap_in(seq)
            assert [h for h, _ in result.mapping] == hosts
            del self.swapped[seq]
            self.seqs[seq] = (namespace, tokens)
            for host, device in result.mapping:
                assert a.refcount(device) == 1
                if device in self.released_at:
                    assert self.last >= self.released_at[device] + self.window
                self.copy_block(host, device, self.host_shadow, self.shadow)
            assert a.block_table(seq) == tuple(d for _, d in result.mapping)
        elif kind == "evict":
            count = rng.randint(0, 3)
            cached = len(a.cached_blocks())
            assert a.evict(count) == min(count, cached)
        elif kind == "reset":
            a.reset_cache()
            assert not a.cached_blocks()


@pytest.mark.parametrize("window", [0, 1, 2])
@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_content_and_accounting(window: int, seed: int) -> None:
    a = make(20, window=window, host=6)
    driver = _Driver(a, random.Random(f"kvfuzz-{window}-{seed}"))
    for _ in range(400):
        driver.op()
    # The driver exercised what it claims to (so a passing run means something).
    assert driver.stats["hits"] > 0 and driver.stats["copies"] > 0
    for seq in sorted(driver.seqs) + sorted(driver.swapped):
        a.free(seq)
    for step in range(driver.last + 1, driver.last + 1 + window + 1):
        a.step_completed(step)
    a.reset_cache()
    assert sorted(a.free_blocks()) == list(range(20)), "quiescence: every block free"
