"""Greedy generation with the tiny model's K/V in kvfuzz's paged pools under any allocator, and the same generation
with a contiguous cache, to show that paging leaves the output unchanged (or, under a broken allocator, that it does
not).

The paged run is a small continuous-batching engine around the allocator. Each round: fork the parallel samples of
requests whose prompt is computed, grow every running sequence by the token it last produced and compute it
(performing the copies the allocator orders first); unless the round preempted, readmit preempted sequences
(recomputing their K/V from the prefix-cache hit on) and admit arriving requests (computing their prompt after the
cache hit); free what is finished; then the round's step completes. When a grow finds the pool full, the most
recently admitted other sequence is preempted for recomputation (under an in-flight window, one victim, and the grow
waits a round for its blocks). Every K/V write goes to the slot the block table names; every read gathers the
sequence's slots.

Sample j of a request takes the (j+1)-th most likely token first and is greedy afterwards (sample 0 is plain greedy),
so parallel samples diverge. The reference computes every sequence alone with a contiguous cache, one token at a
time exactly as the paged run does, so equal K/V give bit-identical logits.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence, cast

import attrs
import torch

from kvfuzz.allocator.errors import OutOfBlocks
from kvfuzz.allocator.protocol import AllocatorProtocol, Forks, Preempts
from kvfuzz.allocator.types import BlockCopy, SeqId
from kvfuzz.model.tiny_lm import ContiguousKV, TinyLM


@attrs.frozen
class GenerationRequest:
    """A request: its prompt, how many tokens each sample generates, how many samples, and its arrival round."""

    id: str  # the request id; sample j > 0 is the sequence ``id/j``
    prompt: tuple[int, ...]  # prompt tokens
    new_tokens: int  # tokens each sample generates (>= 1)
    samples: int = 1  # parallel samples, forked from the computed prompt
    arrival: int = 0  # the first round it may be admitted in

    def sequences(self) -> list[SeqId]:
        return [self.id] + [f"{self.id}/{j}" for j in range(1, self.samples)]


@attrs.frozen
class Generated:
    """One sequence's output: the tokens it generated and, for each, the logits it was chosen from."""

    tokens: tuple[int, ...]  # generated tokens, in order
    logits: tuple[torch.Tensor, ...] = attrs.field(eq=False)  # logits[i] chose tokens[i]


def choose(logits: torch.Tensor, rank: int) -> int:
    """The ``rank``-th most likely token (0: greedy), ties broken by the lower token."""
    return int(torch.argsort(logits, descending=True, stable=True)[rank])


def generate_contiguous(model: TinyLM, requests: Sequence[GenerationRequest]) -> dict[SeqId, Generated]:
    """Every sequence generated alone with a contiguous cache: the reference."""
    outputs = {}
    for request in requests:
        for rank, seq in enumerate(request.sequences()):
            store = ContiguousKV(model.config)
            for position, token in enumerate(request.prompt):
                logits = model.forward_token(token, position, store)
            tokens, chosen = [choose(logits, rank)], [logits]
            while len(tokens) < request.new_tokens:
                logits = model.forward_token(tokens[-1], len(request.prompt) + len(tokens) - 1, store)
                tokens.append(choose(logits, 0))
                chosen.append(logits)
            outputs[seq] = Generated(tuple(tokens), tuple(chosen))
    return outputs


class PagedPools:
    """The K/V pools ``[num_blocks * block_size, layers, heads, head_dim]``; a sequence's position ``p`` lives at row
    ``table[p // block_size] * block_size + p % block_size``."""

    def __init__(self, model: TinyLM, block_size: int, num_blocks: int) -> None:
        config = model.config
        shape = (num_blocks * block_size, config.layers, config.heads, config.head_dim)
        self.block_size = block_size
        self.keys, self.values = torch.zeros(shape), torch.zeros(shape)

    def copy(self, copy: BlockCopy) -> None:
        size = self.block_size
        for pool in (self.keys, self.values):
            pool[copy.dst * size : (copy.dst + 1) * size] = pool[copy.src * size : (copy.src + 1) * size]


@attrs.define
class PagedSequence:
    """One sequence of the paged run, and the :class:`~kvfuzz.model.tiny_lm.KVStore` reading its K/V through its
    block table. ``tokens`` holds the prompt and every generated token; all but the last generated one have K/V."""

    seq: SeqId
    request: GenerationRequest
    rank: int
    pools: PagedPools
    table: tuple[int, ...] = ()
    tokens: list[int] = attrs.field(factory=list)
    logits: list[torch.Tensor] = attrs.field(factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.request.prompt)

    def _slot(self, position: int) -> int:
        size = self.pools.block_size
        return self.table[position // size] * size + position % size

    def write(self, layer: int, position: int, key: torch.Tensor, value: torch.Tensor) -> None:
        slot = self._slot(position)
        self.pools.keys[slot, layer], self.pools.values[slot, layer] = key, value

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.tensor([self._slot(position) for position in range(length)])
        return self.pools.keys[slots, layer], self.pools.values[slots, layer]


class PagedGeneration:
    """The paged run of a batch of requests against one allocator; :meth:`run` returns the outputs, and
    ``events`` counts what happened (admissions, cache-hit tokens, forks, copies, preemptions, frees, reused
    blocks)."""

    def __init__(self, model: TinyLM, allocator: AllocatorProtocol, max_rounds: int = 10_000) -> None:
        self.model, self.allocator, self.max_rounds = model, allocator, max_rounds
        self.pools = PagedPools(model, allocator.block_size, allocator.num_blocks)
        self.events: Counter[str] = Counter()
        self.running: list[PagedSequence] = []  # in admission order
        self.preempted: list[PagedSequence] = []  # oldest preemption first
        self.to_fork: list[PagedSequence] = []  # computed prompts whose samples are not forked yet
        self.outputs: dict[SeqId, Generated] = {}
        self.released: set[int] = set()  # blocks a freed or preempted sequence held

    def _compute(self, sequence: PagedSequence, start: int) -> torch.Tensor:
        """Compute positions ``start ..`` of the sequence's tokens that need K/V; returns the last logits."""
        logits = None
        for position in range(start, len(sequence.tokens) - (sequence.generated > 0)):
            logits = self.model.forward_token(sequence.tokens[position], position, sequence)
        assert logits is not None, "a sequence always computes at least its last token"
        return logits

    def _admit(self, sequence: PagedSequence) -> bool:
        """Admit (or readmit) the sequence with every token that needs K/V, and compute those the cache missed."""
        kv_tokens = sequence.tokens[: len(sequence.tokens) - (sequence.generated > 0)]
        try:
            result = self.allocator.admit(sequence.seq, (), tuple(kv_tokens))
        except OutOfBlocks:
            return False
        sequence.table = tuple(result.block_table)
        self.events["reused blocks"] += len(self.released & set(sequence.table))
        self.events["cache-hit tokens"] += result.num_cached_tokens
        logits = self._compute(sequence, min(result.num_cached_tokens, len(kv_tokens) - 1))
        if sequence.generated == 0:
            sequence.tokens.append(choose(logits, sequence.rank))
            sequence.logits.append(logits)
        self.running.append(sequence)
        return True

    def _preempt_for(self, grower: PagedSequence) -> bool:
        victims = [sequence for sequence in reversed(self.running) if sequence is not grower]
        if not victims:
            return False
        victim = victims[0]
        self.released |= set(victim.table)
        cast(Preempts, self.allocator).preempt(victim.seq)
        self.running.remove(victim)
        self.preempted.append(victim)
        self.events["preemptions"] += 1
        return True

    def _grow(self, sequence: PagedSequence) -> None:
        """Append the last generated token, compute it, and choose the next (greedy). When the pool is full, preempt
        the most recently admitted other sequence and retry; under an in-flight window (released blocks come back
        only after later steps) or with no other sequence to preempt, wait for the next round instead."""
        while True:
            try:
                result = self.allocator.grow(sequence.seq, (sequence.tokens[-1],))
                break
            except OutOfBlocks:
                if not self._preempt_for(sequence) or self.allocator.capabilities.inflight_window > 0:
                    return
        for copy in result.copies:
            self.pools.copy(copy)
            self.events["copy-on-write copies"] += 1
        sequence.table = tuple(self.allocator.block_table(sequence.seq))
        position = len(sequence.tokens) - 1
        logits = self.model.forward_token(sequence.tokens[-1], position, sequence)
        sequence.tokens.append(choose(logits, 0))
        sequence.logits.append(logits)

    def _fork(self, parent: PagedSequence) -> None:
        logits = parent.logits[0]
        for rank, child in enumerate(parent.request.sequences()[1:], start=1):
            copies = cast(Forks, self.allocator).fork(parent.seq, child) or ()
            for copy in copies:
                self.pools.copy(copy)
                self.events["fork copies"] += 1
            sequence = PagedSequence(child, parent.request, rank, self.pools, tuple(self.allocator.block_table(child)))
            sequence.tokens = list(parent.request.prompt) + [choose(logits, rank)]
            sequence.logits = [logits]
            self.running.append(sequence)
            self.events["forks"] += 1

    def _finish(self) -> None:
        for sequence in list(self.running):
            if sequence.generated >= sequence.request.new_tokens and sequence not in self.to_fork:
                self.released |= set(sequence.table)
                self.allocator.free(sequence.seq)
                self.running.remove(sequence)
                self.outputs[sequence.seq] = Generated(
                    tuple(sequence.tokens[len(sequence.request.prompt) :]), tuple(sequence.logits)
                )
                self.events["frees"] += 1

    def _admissions(self, arriving: list[GenerationRequest], round_: int) -> None:
        """Readmit preempted sequences, oldest first, then admit arrived requests, first come first served; the
        first refusal ends the round's admissions."""
        while self.preempted:
            if not self._admit(self.preempted[0]):
                return
            self.preempted.pop(0)
            self.events["readmissions"] += 1
        while arriving and arriving[0].arrival <= round_:
            request = arriving[0]
            sequence = PagedSequence(request.id, request, 0, self.pools, tokens=list(request.prompt))
            if not self._admit(sequence):
                return
            arriving.pop(0)
            self.events["admissions"] += 1
            if request.samples > 1:
                self.to_fork.append(sequence)

    def run(self, requests: Sequence[GenerationRequest]) -> dict[SeqId, Generated]:
        arriving = sorted(requests, key=lambda request: request.arrival)
        total = sum(request.samples for request in requests)
        for round_ in range(self.max_rounds):
            if len(self.outputs) == total:
                return self.outputs
            preemptions = self.events["preemptions"]
            for parent in list(self.to_fork):
                if parent in self.running:
                    self._fork(parent)
                    self.to_fork.remove(parent)
            for sequence in list(self.running):
                if (
                    sequence in self.running
                    and sequence not in self.to_fork
                    and sequence.generated < sequence.request.new_tokens
                ):
                    self._grow(sequence)
            if self.events["preemptions"] == preemptions:  # no (re)admission in a round that had to preempt
                self._admissions(arriving, round_)
            self._finish()
            self.allocator.step_completed(round_)
        raise RuntimeError(f"generation did not finish within {self.max_rounds} rounds")


def differences(paged: dict[SeqId, Generated], reference: dict[SeqId, Generated], limit: int = 5) -> list[str]:
    """Where the paged run's tokens or logits differ from the reference's, one line per sequence (first
    ``limit``); empty when every token and every logit is equal, bit for bit."""
    found = []
    for seq, expected in reference.items():
        got: Optional[Generated] = paged.get(seq)
        if got is None:
            found.append(f"{seq}: missing from the paged run")
            continue
        for index, (want, have) in enumerate(zip(expected.logits, got.logits)):
            if not torch.equal(want, have):
                found.append(
                    f"{seq}: logits of generated token {index} differ by up to {float((want - have).abs().max()):.3g}"
                    f"; tokens {list(got.tokens)} instead of {list(expected.tokens)}"
                )
                break
        else:
            if got.tokens != expected.tokens:
                found.append(f"{seq}: tokens {list(got.tokens)} instead of {list(expected.tokens)}")
    return found[:limit]
