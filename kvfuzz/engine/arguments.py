"""How an operation's arguments are drawn, by Hypothesis or by a plain random generator, and how a recorded argument
is judged valid on replay: one description serves all three.

Prompts are a shared "system prompt" (lengths chosen around block boundaries) followed by a short, non-empty
suffix over a tiny vocabulary, so equal prefixes, equal full blocks and near misses are common. Namespaces include
pairs whose parts concatenate to the same string, and the same tokens are drawn under several namespaces.

Each argument kind draws the same distribution both ways: :meth:`strategy` for the Hypothesis machine (it reads the
machine's state through ``st.runner()``, whose ``expected`` attribute is a :class:`ProgramState`), :meth:`draw`
for random programs, :meth:`accepts` for replay. Hypothesis is imported only when a strategy is built: the engine's
features declare their operations with these kinds, and the engine runs without Hypothesis.
"""

from __future__ import annotations

import functools
import random
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Sequence, TypeVar, Union

import attrs

from kvfuzz.allocator.types import Namespace, SeqId
from kvfuzz.engine.expected import Census, DerivedIds, ExpectedState, ProgramState, Status

if TYPE_CHECKING:
    from hypothesis import strategies as st

T = TypeVar("T")

VOCABULARY = 4
"""Token ids are 0 .. VOCABULARY - 1: few enough that prompts share prefixes often."""

NAMESPACES: tuple[Namespace, ...] = ((), ("ab", "c"), ("a", "bc"), ("lora-7",))
"""Mostly the empty namespace first, so that most requests can share; then the two whose parts concatenate alike
(Hypothesis favours the first choices)."""


class Snapshot:
    """The state's queries, each answered once: enablement asks every operation in turn, and most ask for the same
    lists (running, computed). Every query of :class:`ProgramState` passes through, none named here: an attribute is
    the state's own, and a method's answer is kept per arguments. Valid until the state changes, that is, until the
    next call is executed, after which :meth:`renewed` forgets every answer; ids (:data:`DRAWS`) are still drawn from
    the state itself."""

    DRAWS = frozenset({"new_id"})
    """Queries that change the state: passed through, never kept."""

    KEPT = frozenset({"caps", "block_size", "num_host_blocks", "finished"})
    """Attributes the state sets when it is made and never reassigns (``finished`` is one list, appended to in place,
    so the snapshot reads it live, as it always did): kept across renewals."""

    def __init__(self, state: ProgramState) -> None:
        self._state = state  # the live state behind the answers
        self._answers: dict[object, Any] = {}  # (query, its arguments) -> its answer; a pick -> its options
        self._attributes: list[str] = []  # the state's attributes kept on the snapshot since it was last renewed

    def renewed(self) -> Snapshot:
        """This snapshot with every answer and attribute it kept forgotten, for the state as it is now (after a
        call): cheaper than a new one, since its queries stay bound to the same state."""
        self._answers.clear()
        for name in self._attributes:
            del self.__dict__[name]
        self._attributes.clear()
        return self

    def __getattr__(self, name: str) -> Any:
        """The state's attribute, or its query answered once per arguments; kept on the snapshot, so that a query
        asked again costs a dictionary lookup (an attribute until :meth:`renewed`, a query for good, its answers
        until then)."""
        if name.startswith("_"):  # never the state's private parts (nor, before __init__, a lookup of _state)
            raise AttributeError(name)
        asked = getattr(self._state, name)
        if not callable(asked) or name in self.DRAWS:
            setattr(self, name, asked)
            if name not in self.KEPT:
                self._attributes.append(name)
            return asked
        answers = self._answers

        def query(*args: Any) -> Any:
            key = (name, *args)
            answer = answers.get(key, answers)  # the dictionary itself: no answer yet (no query answers with it)
            if answer is answers:
                answer = answers[key] = asked(*args)
            return answer

        setattr(self, name, query)
        return query

    def kept(self, key: object, make: Callable[[], T]) -> T:
        """The caller's own answer for the state now (random programs' enabled list), made once per state: ``key``
        (hashable, equal to no query's tuple key nor any pick) names it."""
        answers = self._answers
        answer = answers.get(key, answers)
        if answer is answers:
            answer = answers[key] = make()
        return answer  # type: ignore[no-any-return]

    def gates(self, gates: Sequence[Callable[["Snapshot"], object]]) -> tuple[bool, ...]:
        """Whether each of ``gates`` (an operation's condition, or a pick's options) answers true now, each answer
        kept as :meth:`options` keeps a pick's: what enablement asks before every call, in one pass."""
        answers = self._answers
        found = []
        for gate in gates:
            answer = answers.get(gate, answers)
            if answer is answers:
                answer = answers[gate] = gate(self)
            found.append(bool(answer))
        return tuple(found)

    def options(self, pick: Callable[["Snapshot"], Sequence[Any]]) -> Sequence[Any]:
        """What a :class:`Pick` may choose from now, asked once per state however many times enablement and the
        draw ask it (the misuse calls, for one, are built anew by each asking)."""
        answers = self._answers  # keyed by the pick itself: a query's key is a tuple, never equal to a function
        options = answers.get(pick, answers)
        if options is answers:
            options = answers[pick] = pick(self)
        return options


class CensusSnapshot(Snapshot, DerivedIds):
    """A :class:`Snapshot` of the engine's :class:`ExpectedState` whose sequence lists (``ids`` of a status,
    ``live_ids``, ``computed_ids``: most of what enablement asks) come from the state's index of the sequences
    (:meth:`ExpectedState.census`), asked at most once per state, instead of a pass for each list. The answers are
    the state's own (the same lists, in the same order), and so are the lists made from them (:class:`DerivedIds`:
    preemptible, freeable, rollbackable), made here from the census's; every other query passes through as in
    :class:`Snapshot`.

    Its answers outlive a call that changed nothing enablement reads: :meth:`renewed` forgets them only when the
    state's :meth:`~ExpectedState.stamp` differs from the one they were answered under (a refused call, a misuse
    call, an eviction that released nothing keep them)."""

    def __init__(self, state: ExpectedState) -> None:
        super().__init__(state)
        self._expected = state  # the state, typed as what makes a census
        self._stamp: Optional[tuple[int, ...]] = None  # the state's stamp when the answers kept were answered
        self._census: Optional[Census] = None  # the state's census, once asked since the answers were last forgotten
        # Each sequence's rollback limit, asked of the state directly: rollbackable_ids asks it once per running
        # sequence per state, and nothing else asks it through the snapshot, so keeping its answers would cost more.
        self.rollback_limit = state.rollback_limit

    def renewed(self) -> Snapshot:
        """This snapshot for the state as it is now: its answers kept if nothing they read changed since."""
        stamp = self._expected.stamp()
        if stamp == self._stamp:
            return self
        self._stamp = stamp
        self._census = None
        return super().renewed()

    def ids(self, status: Status, groups: bool = False) -> list[SeqId]:
        if groups:  # group tables: not in the census (enablement never asks for them)
            return self._expected.ids(status, groups)
        census = self._census or self._take_census()
        return census.by_status[status]

    def live_ids(self) -> list[SeqId]:
        return (self._census or self._take_census()).live

    def computed_ids(self) -> list[SeqId]:
        return (self._census or self._take_census()).computed

    def _take_census(self) -> Census:
        census = self._census = self._expected.census()
        return census


def snapshot_of(state: ProgramState) -> Snapshot:
    """The snapshot enablement and draws read for ``state``: a :class:`CensusSnapshot` of the engine's state, a plain
    :class:`Snapshot` of any other (the benchmark's bare machine)."""
    return CensusSnapshot(state) if isinstance(state, ExpectedState) else Snapshot(state)


def computed(state: ProgramState) -> list[SeqId]:
    """The computed sequences: what a fork's parent and a swap-out are picked from, and what a decode needs one of.
    One function for all three, so that enablement asks it once per state."""
    return state.computed_ids()


def finished_any(state: ProgramState) -> bool:
    """Whether some sequence has finished (so the cache may hold something): one function for every operation that
    needs it, so that enablement asks it once per state."""
    return bool(state.finished)


@functools.lru_cache(maxsize=None)
def system_prompts(block_size: int) -> tuple[tuple[int, ...], ...]:
    """Shared prefixes just below, at, and just past block boundaries (made once per block size)."""
    lengths = sorted({0, block_size - 1, block_size, 2 * block_size, 2 * block_size + 1})
    return tuple(tuple((i * 7 + length) % VOCABULARY for i in range(length)) for length in lengths if length >= 0)


@attrs.frozen
class Pick:
    """One of the values ``options(state)`` lists now: a sequence in some state, a namespace, a system prompt."""

    gating: ClassVar[bool] = True  # whether it can have nothing to draw from (enablement asks it)

    options: Callable[[ProgramState], Sequence[Any]]

    def _choices(self, state: ProgramState) -> Sequence[Any]:
        return state.options(self.options) if isinstance(state, Snapshot) else self.options(state)

    def available(self, state: ProgramState) -> bool:
        return bool(self._choices(state))

    def strategy(self) -> st.SearchStrategy[Any]:
        from hypothesis import strategies as st

        return st.runner().flatmap(lambda machine: st.sampled_from(self._choices(machine.expected)))

    def draw(self, state: ProgramState, rng: random.Random) -> Any:
        return rng.choice(self._choices(state))

    def accepts(self, state: ProgramState, value: Any) -> bool:
        return value in self._choices(state)


@attrs.frozen
class FilledPick(Pick):
    """A :class:`Pick` whose options are never empty, in any state (the misuse calls: growing a sequence nobody
    admitted is always one; the namespaces; the system prompts, the empty one among them), so that enablement need
    not build them: they are built only when drawn from."""

    gating: ClassVar[bool] = False  # whether it can have nothing to draw from (enablement asks it)


@attrs.frozen
class NewSeqId:
    """A sequence id never used before in this example."""

    gating: ClassVar[bool] = False  # whether it can have nothing to draw from (enablement asks it)

    def available(self, state: ProgramState) -> bool:
        return True

    def strategy(self) -> st.SearchStrategy[SeqId]:
        from hypothesis import strategies as st

        return st.runner().map(lambda machine: machine.expected.new_id())

    def draw(self, state: ProgramState, rng: random.Random) -> SeqId:
        return state.new_id()

    def accepts(self, state: ProgramState, value: Any) -> bool:
        return isinstance(value, str) and state.is_fresh(value)


@attrs.frozen
class Integers:
    """An integer from ``low`` to ``high``, both included."""

    gating: ClassVar[bool] = False  # whether it can have nothing to draw from (enablement asks it)

    low: int
    high: int

    def available(self, state: ProgramState) -> bool:
        return True

    def strategy(self) -> st.SearchStrategy[int]:
        from hypothesis import strategies as st

        return st.integers(self.low, self.high)

    def draw(self, state: ProgramState, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def accepts(self, state: ProgramState, value: Any) -> bool:
        return type(value) is int and self.low <= value <= self.high


@attrs.frozen
class BlockIds:
    """One to ``most`` distinct block ids, each one of those ``options(state)`` lists now (targeted eviction's
    victims), in the order drawn."""

    gating: ClassVar[bool] = True  # whether it can have nothing to draw from (enablement asks it)

    options: Callable[[ProgramState], Sequence[int]]
    most: int = 3

    def available(self, state: ProgramState) -> bool:
        return bool(self.options(state))

    def strategy(self) -> st.SearchStrategy[list[int]]:
        from hypothesis import strategies as st

        return st.runner().flatmap(lambda machine: self._subsets(list(self.options(machine.expected))))

    def _subsets(self, options: list[int]) -> st.SearchStrategy[list[int]]:
        """One to ``most`` distinct ``options`` in drawn order (a first pick, then up to ``most - 1`` more, repeats
        dropped)."""
        from hypothesis import strategies as st

        picks = st.lists(st.sampled_from(options), min_size=1, max_size=self.most)
        return picks.map(lambda drawn: list(dict.fromkeys(drawn)))

    def draw(self, state: ProgramState, rng: random.Random) -> list[int]:
        options = list(self.options(state))
        return rng.sample(options, rng.randint(1, min(self.most, len(options))))

    def accepts(self, state: ProgramState, value: Any) -> bool:
        if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= self.most or len(set(value)) != len(value):
            return False
        options = set(self.options(state))
        return all(type(block) is int and block in options for block in value)


LengthRanges = Callable[[ProgramState], tuple[tuple[int, int], ...]]
"""The state (its block size, what the allocator declares) -> the (shortest, longest) length ranges a token list is
drawn from, each equally likely."""


@functools.lru_cache(maxsize=None)
def _token_lists(ranges: tuple[tuple[int, int], ...]) -> st.SearchStrategy[list[int]]:
    from hypothesis import strategies as st

    token = st.integers(0, VOCABULARY - 1)
    lists = [st.lists(token, min_size=low, max_size=high) for low, high in ranges]
    return lists[0] if len(lists) == 1 else st.one_of(*lists)


@attrs.frozen
class TokenLists:
    """A list of token ids whose length lies in one of ``ranges(state)``: the range first (each equally likely), then
    the length within it, then the tokens."""

    gating: ClassVar[bool] = False  # whether it can have nothing to draw from (enablement asks it)

    ranges: LengthRanges

    def available(self, state: ProgramState) -> bool:
        return True

    def strategy(self) -> st.SearchStrategy[list[int]]:
        from hypothesis import strategies as st

        return st.runner().flatmap(lambda machine: _token_lists(self.ranges(machine.expected)))

    def draw(self, state: ProgramState, rng: random.Random) -> list[int]:
        ranges = self.ranges(state)
        low, high = ranges[int(rng.random() * len(ranges))] if len(ranges) > 1 else ranges[0]
        return [rng.randrange(VOCABULARY) for _ in range(rng.randint(low, high))]

    def accepts(self, state: ProgramState, value: Any) -> bool:
        if not isinstance(value, (list, tuple)) or not all(type(t) is int and 0 <= t < VOCABULARY for t in value):
            return False
        return any(low <= len(value) <= high for low, high in self.ranges(state))


Argument = Union[Pick, FilledPick, NewSeqId, Integers, TokenLists, BlockIds]
