"""One Hypothesis search of a state machine, for every target: the machine run under explicit settings, seeded or
derandomized the same way, its draws a function of the seed and the machine alone, and how it ended told apart once.

How it ended is one of four (:class:`Searched`): it passed; the machine raised on an example (the failure, shrunk by
Hypothesis unless its settings leave shrinking out); Hypothesis's replay of a failing example went differently
(``flaky``: Hypothesis's ``Flaky``, with the failure it first saw where it kept one), which the target settles from
the failing examples it met itself; or Hypothesis itself failed otherwise (its own error, or a plain exception its
own code raised), which is never a finding (``hypothesis_error``). A stop raised into the search from outside is
never any of them: the user's Ctrl-C (:class:`~kvfuzz.program.safeguards.UserInterrupt`) is raised again, found
inside whatever Hypothesis wrapped it in or behind whatever Hypothesis's half-updated bookkeeping raised as it
unwound; a caller's cut-off (``cut_offs``) ends the search as ``cut_off``, likewise. Every other ``BaseException``
(a hang, kvfuzz's own harness error) passes through to the caller.

Hypothesis seeds part of its generation with constants it reads from the source of "local" modules (any module not
under ``site-packages``). kvfuzz's own modules are local when it runs from a checkout and not when it is installed,
so the same derandomized run drew differently in the two (a README sample generated from a checkout did not match
what an installed ``kvfuzz`` printed), and again after any edit to a literal anywhere in kvfuzz (a docstring moved
into field metadata shifted which example first caught a zoo variant). Under :func:`source_independent_draws` the
search reads no local constants: a derandomized run is the same wherever kvfuzz is installed and whatever its
source text says. Hypothesis's global constants (the edge cases it always tries) still apply.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional, cast

import attrs
import hypothesis
from hypothesis import seed as hypothesis_seed
from hypothesis import settings as Settings
from hypothesis.errors import Flaky, HypothesisException
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test
from hypothesis.statistics import collector

from kvfuzz.program.safeguards import UserInterrupt, carried, stop_behind


@attrs.frozen
class Searched:
    """How one Hypothesis search ended. At most one of ``failure``, ``hypothesis_error`` and ``cut_off`` is set;
    ``flaky`` may come with a ``failure`` (the one Hypothesis first saw, inside its Flaky) or alone."""

    failure: Optional[BaseException] = None  # what the machine raised on its falsifying example (first, when flaky):
    # an Exception, or inside a Flaky what the machine let through (a hang)
    flaky: Optional[Flaky] = None  # Hypothesis's replay of a failing example went differently, and said so here
    # Hypothesis's own error, not a Flaky (a HypothesisException, or a plain exception its own code raised): never a
    # finding
    hypothesis_error: Optional[Exception] = None
    cut_off: bool = False  # one of the caller's cut-offs ended it, raised bare or inside Hypothesis's error
    examples: Optional[int] = None  # examples of its explicit, reuse and generate phases (None: it reported none)
    report: tuple[str, ...] = ()  # what Hypothesis printed (where it prints its falsifying example)

    @property
    def error(self) -> Optional[Exception]:
        """Hypothesis's own error, a Flaky included (None: it raised none)."""
        return self.flaky if self.flaky is not None else self.hypothesis_error


def search_machine(
    machine: type[RuleBasedStateMachine],
    settings: Settings,
    seed: Optional[int] = None,
    database_key: Optional[bytes] = None,
    cut_offs: tuple[type[BaseException], ...] = (),
) -> Searched:
    """Run ``machine`` under ``settings``, Hypothesis seeded with ``seed`` (None: as ``settings`` say), and say how it
    ended (see the module). ``database_key`` replaces the part of the example database's key that Hypothesis derives
    from the machine class, so that searches of one class under different configurations keep their examples
    apart. Raises the user's interrupt, and any ``BaseException`` that is neither an ``Exception`` nor a cut-off."""
    test = get_state_machine_test(machine, settings=settings)
    if database_key is not None:
        cast(Any, test).hypothesis.inner_test._hypothesis_internal_add_digest = database_key
    if seed is not None:
        test = hypothesis_seed(seed)(test)
    counted = _HypothesisCount()
    report: list[str] = []
    ended = Searched()
    try:
        with (
            with_reporter(lambda value: report.append(str(value))),
            cast(Any, collector).with_value(counted),
            source_independent_draws(),
        ):
            test()
    except HypothesisException as error:
        ended = _hypothesis_s(error, cut_offs)
    except Exception as error:  # noqa: BLE001 -- what the machine raised is its failure, unless a stop caused it
        ended = _exception_s(error, cut_offs)
    except cut_offs:
        ended = Searched(cut_off=True)
    return attrs.evolve(ended, examples=counted.examples, report=tuple(report))


def _exception_s(error: Exception, cut_offs: tuple[type[BaseException], ...]) -> Searched:
    """How a search that ended in a plain ``error`` ended. A stop raised from outside can land inside Hypothesis's
    own bookkeeping (an alarm fires between two lines of its drawing code), which then fails on its half-updated
    state as it unwinds (an ``IndexError`` in ``ConjectureData.stop_span``, an ``AssertionError``, with the stop as
    their context): that is the stop, the user's interrupt raised again, a cut-off ending the search. An error
    raised by Hypothesis's own code with no stop behind it is Hypothesis's error. Anything else is the machine's
    failure."""
    stop = stop_behind(error, (UserInterrupt, *cut_offs))
    if isinstance(stop, UserInterrupt):
        raise stop from None
    if stop is not None:
        return Searched(cut_off=True)
    if _raised_by_hypothesis(error):
        return Searched(hypothesis_error=error)
    return Searched(failure=error)


def _raised_by_hypothesis(error: BaseException) -> bool:
    """Whether the innermost frame of ``error``'s traceback is Hypothesis's own code."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return _HYPOTHESIS_ROOT in traceback.tb_frame.f_code.co_filename


_HYPOTHESIS_ROOT = os.path.join(os.path.dirname(os.path.abspath(hypothesis.__file__)), "")
"""The directory of Hypothesis's package (a path that ends in a separator: ``hypothesis_foo`` is not under it)."""


def _hypothesis_s(error: HypothesisException, cut_offs: tuple[type[BaseException], ...]) -> Searched:
    """How a search that ended in Hypothesis's own ``error`` ended: a stop from outside found inside it first (the
    user's interrupt raised, a cut-off), then the machine's failure inside a ``Flaky``, else Hypothesis's error."""
    interrupt = carried(error, UserInterrupt)
    if interrupt is not None:  # the user's Ctrl-C, landed while Hypothesis drew or replayed an example
        raise interrupt from None
    if any(carried(error, kind) is not None for kind in cut_offs):  # likewise, the caller's cut-off: Hypothesis
        return Searched(cut_off=True)  # then finds its data drawn differently and says so
    if not isinstance(error, Flaky):
        return Searched(hypothesis_error=error)
    inner = [failure for failure in getattr(error, "exceptions", ()) if not isinstance(failure, Flaky)]
    return Searched(failure=inner[0] if inner else None, flaky=error)


class _HypothesisCount:
    """Counts the examples Hypothesis ran in its search phases, from the statistics it reports at the end."""

    def __init__(self) -> None:
        self.examples: Optional[int] = None

    def __call__(self, statistics: dict[str, Any]) -> None:
        cases = [
            case
            for phase in ("explicit", "reuse", "generate")
            for case in statistics.get(f"{phase}-phase", {}).get("test-cases", [])
        ]
        self.examples = sum(case.get("status") in ("valid", "interesting") for case in cases)


@contextlib.contextmanager
def source_independent_draws() -> Iterator[None]:
    """Within: Hypothesis draws no constants from local modules' source (its cache of them emptied on the way in and
    out, so a search before or after, in the same process, sees its own). Where this Hypothesis has no such feature,
    nothing changes."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants
    except ImportError:  # a Hypothesis without local constants: its draws already are
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    cache: Any = getattr(providers, "CONSTANTS_CACHE", None)
    if original is None or cache is None:
        yield
        return
    none = Constants()
    cache.cache.clear()
    providers._get_local_constants = lambda: none
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.cache.clear()
