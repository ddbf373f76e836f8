"""Hypothesis's draws, made a function of the seed and the machine alone.

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
from typing import Any, Iterator


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
