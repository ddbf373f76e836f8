"""An allocator trace's program as the straight-line calls of a reproducer's session: one line per kvfuzz operation,
its arguments written out (an admission's whole prompt, a namespace as the engine's key), and the operation's own
words as a comment above it. The session (each family's runtime) plays the engine around the allocator the way
kvfuzz's engine does, so a line here is one operation of the shrunk program."""

from __future__ import annotations

from typing import Any, Callable

from kvfuzz.reproducer_text import NotReproducible, comment
from kvfuzz.saved.trace import Trace

__all__ = ["KeyOf", "NotReproducible", "calls", "comment"]

KeyOf = Callable[[tuple[str, ...]], Any]
"""How a family writes a namespace as the engine's key (a cache salt, a LoRA id, extra-key fields)."""


def calls(trace: Trace, key_of: KeyOf, supported: frozenset[str]) -> list[str]:
    """The session's calls playing ``trace``'s program; raises :class:`NotReproducible` for an operation the
    family's session does not play."""
    lines = []
    for entry in trace.program:
        rule, arguments = entry.rule, entry.kwargs()
        if rule not in supported:
            raise NotReproducible(f"operation {rule} is not played by this engine's reproducer session")
        lines.append("# " + str(entry).removeprefix("state."))
        if rule == "admit":
            tokens = list(arguments["system"]) + list(arguments["suffix"])
            key = key_of(tuple(arguments["namespace"]))
            lines.append(f"session.admit({arguments['seq']!r}, {key!r}, {tokens})")
        elif rule in ("step", "reset_cache"):
            lines.append(f"session.{rule}()")
        elif rule == "grow":
            lines.append(f"session.grow({arguments['seq']!r}, {list(arguments['tokens'])})")
        elif rule == "fork":
            lines.append(f"session.fork({arguments['child']!r}, {arguments['parent']!r})")
        else:
            values = ", ".join(repr(list(value) if isinstance(value, tuple) else value) for value in arguments.values())
            lines.append(f"session.{rule}({values})")
    return lines
