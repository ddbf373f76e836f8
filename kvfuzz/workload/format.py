"""The ``kvfuzz-workload/1`` trace format: requests with arrival steps, prompts, output lengths, shared prefixes,
parallel samples and cancellations.

A file is one JSON object::

    {"format": "kvfuzz-workload/1",
     "name": "shared-system-prompt",
     "origin": "constructed",                 # or "recorded": where the requests came from
     "description": "...",
     "prefix_groups": {"system": {"length": 64}},          # or {"tokens": [...]}
     "requests": [
        {"id": "r0", "arrival": 0, "prompt_len": 12, "output_len": 20, "prefix_group": "system"},
        {"id": "r1", "arrival": 3, "prompt": [5, 9, 2], "output_len": 4, "samples": 2, "cancel_at": 7,
         "namespace": ["lora:a"]}]}

Steps count forward passes from 0. A request may be admitted in the scheduling round before step ``arrival``; its
prompt is its group's prefix followed by its own ``prompt`` tokens (or ``prompt_len`` tokens derived from its id);
``samples`` > 1 decodes that many branches from one prompt (forked where the allocator can fork); ``cancel_at``
(not before ``arrival``) cancels it in the scheduling round before that step, wherever it is. ``id``, ``arrival``,
``output_len`` and one of ``prompt`` and ``prompt_len`` are required; a field not named here is refused, so that a
misspelled one is not silently ignored.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from pathlib import Path
from typing import Any, Optional

import attrs

from kvfuzz.allocator.types import Namespace, Tokens
from kvfuzz.workload.provenance import Provenance

FORMAT = "kvfuzz-workload/1"
ORIGINS = ("constructed", "recorded")
VOCABULARY = 32000
WORKLOAD_FIELDS = ("format", "name", "origin", "provenance", "description", "prefix_groups", "requests")
REQUEST_FIELDS = (
    "id",
    "arrival",
    "prompt",
    "prompt_len",
    "output_len",
    "samples",
    "cancel_at",
    "namespace",
    "prefix_group",
)


class WorkloadError(ValueError):
    """A workload file that cannot be read: says which request and which field."""


def derived_tokens(name: str, count: int) -> Tokens:
    """``count`` tokens determined by ``name`` alone, so a trace may give lengths instead of token lists."""
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    generator = random.Random(seed)
    return tuple(generator.randrange(VOCABULARY) for _ in range(count))


@attrs.frozen
class Request:
    """One request of a workload; ``prompt`` already includes its prefix group's tokens."""

    id: str
    arrival: int
    prompt: Tokens
    output_len: int
    samples: int = 1
    cancel_at: Optional[int] = None
    namespace: Namespace = ()
    prefix_group: Optional[str] = None

    def output_token(self, sample: int, index: int) -> int:
        """The ``index``-th generated token of branch ``sample``: branches diverge from their first token."""
        digest = hashlib.blake2b(f"{self.id}/{sample}/{index}".encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % VOCABULARY


@attrs.frozen
class Workload:
    """A named, ordered set of requests, labelled with where they came from (``constructed`` or ``recorded``);
    ``provenance.kind`` is always ``origin``."""

    name: str  # the workload's name
    origin: str  # constructed or recorded
    description: str  # what it holds, for a person
    requests: tuple[Request, ...]  # sorted by arrival
    prefix_groups: dict = attrs.field(factory=dict)  # group name -> its prefix tokens
    provenance: Optional[Provenance] = None  # who made it, or which trace it came from (None: only its origin known)

    @property
    def source(self) -> Provenance:
        """The provenance, or just the origin when the workload does not say more."""
        return self.provenance if self.provenance is not None else Provenance(self.origin)


def _unknown_fields(entry: dict, known: tuple[str, ...], where: str) -> None:
    """Refuse a field the format does not define (most often a misspelling, which would otherwise be ignored)."""
    unknown = [key for key in entry if key not in known]
    if unknown:
        guesses = {key: difflib.get_close_matches(str(key), known, n=1) for key in unknown}
        named = ", ".join(
            f"{key!r}" + (f" (did you mean {guesses[key][0]!r}?)" if guesses[key] else "") for key in unknown
        )
        raise WorkloadError(
            f"{where}: unknown field{'s' if len(unknown) > 1 else ''} {named}; the fields are {', '.join(known)}"
        )


def _checked_int(value: Any, key: str, where: str, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise WorkloadError(f"{where}: {key!r} must be an integer >= {minimum}, found {value!r}")
    return value


def _int(entry: dict, key: str, where: str, minimum: int) -> Optional[int]:
    """``entry[key]`` checked, or None if ``entry`` has no ``key``."""
    return _checked_int(entry[key], key, where, minimum) if key in entry else None


def _int_or(entry: dict, key: str, where: str, minimum: int, default: int) -> int:
    """``entry[key]`` checked, or ``default`` if ``entry`` has no ``key``."""
    return _checked_int(entry.get(key, default), key, where, minimum)


def _tokens(value: Any, where: str) -> Tokens:
    if not isinstance(value, list) or not all(isinstance(token, int) and token >= 0 for token in value):
        raise WorkloadError(f"{where}: expected a list of non-negative integer tokens")
    return tuple(value)


def _groups(raw: Any) -> dict[str, Tokens]:
    if not isinstance(raw, dict):
        raise WorkloadError("'prefix_groups' must be an object mapping group names to {length} or {tokens}")
    groups = {}
    for name, spec in raw.items():
        where = f"prefix group {name!r}"
        if isinstance(spec, dict) and len(spec) == 1 and "tokens" in spec:
            groups[name] = _tokens(spec["tokens"], where)
        elif isinstance(spec, dict) and len(spec) == 1 and "length" in spec:
            groups[name] = derived_tokens(f"group:{name}", _checked_int(spec["length"], "length", where, 1))
        else:
            raise WorkloadError(f'{where}: expected {{"length": N}} or {{"tokens": [...]}}')
    return groups


def _request(entry: Any, number: int, groups: dict[str, Tokens]) -> Request:
    if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
        raise WorkloadError(f"request #{number}: expected an object with a non-empty string 'id'")
    where = f"request {entry['id']!r} (#{number})"
    _unknown_fields(entry, REQUEST_FIELDS, where)
    if "/" in entry["id"]:
        raise WorkloadError(f"{where}: 'id' may not contain '/', which names a request's parallel samples (id/1, ...)")
    group = entry.get("prefix_group")
    if group is not None and group not in groups:
        raise WorkloadError(f"{where}: prefix group {group!r} is not defined in 'prefix_groups'")
    if ("prompt" in entry) == ("prompt_len" in entry):
        raise WorkloadError(f"{where}: give exactly one of 'prompt' (tokens) and 'prompt_len'")
    own = (
        _tokens(entry["prompt"], f"{where} 'prompt'")
        if "prompt" in entry
        else derived_tokens(entry["id"], _checked_int(entry["prompt_len"], "prompt_len", where, 0))
    )
    prompt = (groups[group] if group else ()) + own
    if not prompt:
        raise WorkloadError(f"{where}: the prompt is empty")
    arrival = _int(entry, "arrival", where, 0)
    if arrival is None:
        raise WorkloadError(f"{where}: 'arrival' is required")
    if "output_len" not in entry:
        raise WorkloadError(f"{where}: 'output_len' is required (the tokens it generates, >= 1)")
    cancel_at = _int(entry, "cancel_at", where, 0)
    if cancel_at is not None and cancel_at < arrival:
        raise WorkloadError(f"{where}: 'cancel_at' {cancel_at} is before its 'arrival' {arrival}")
    namespace = entry.get("namespace", [])
    if not isinstance(namespace, list) or not all(isinstance(part, str) for part in namespace):
        raise WorkloadError(f"{where}: 'namespace' must be a list of strings")
    return Request(
        entry["id"],
        arrival,
        prompt,
        _checked_int(entry["output_len"], "output_len", where, 1),
        _int_or(entry, "samples", where, 1, default=1),
        cancel_at,
        tuple(namespace),
        group,
    )


def parse_workload(data: Any, where: str = "workload") -> Workload:
    """A :class:`Workload` from the decoded JSON object, or a :class:`WorkloadError` naming what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise WorkloadError(f"{where}: not a {FORMAT} file (its 'format' field must be {FORMAT!r})")
    _unknown_fields(data, WORKLOAD_FIELDS, where)
    origin = data.get("origin")
    if origin not in ORIGINS:
        raise WorkloadError(f"{where}: 'origin' must be one of {ORIGINS}, found {origin!r}")
    provenance = None
    if "provenance" in data:
        try:
            provenance = Provenance.from_json(data["provenance"], where)
        except ValueError as error:
            raise WorkloadError(str(error)) from error
        if provenance.kind != origin:
            raise WorkloadError(f"{where}: provenance kind {provenance.kind!r} contradicts origin {origin!r}")
    groups = _groups(data.get("prefix_groups", {}))
    raw = data.get("requests")
    if not isinstance(raw, list) or not raw:
        raise WorkloadError(f"{where}: 'requests' must be a non-empty list")
    requests = [_request(entry, number, groups) for number, entry in enumerate(raw, start=1)]
    seen: set[str] = set()
    for request in requests:
        if request.id in seen:
            raise WorkloadError(f"{where}: request id {request.id!r} appears twice")
        seen.add(request.id)
    requests.sort(key=lambda request: request.arrival)
    return Workload(
        str(data.get("name", Path(where).stem)),
        origin,
        str(data.get("description", "")),
        tuple(requests),
        groups,
        provenance,
    )


def load_workload(path: Path) -> Workload:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise WorkloadError(f"{path}: {error}") from error
    return parse_workload(data, str(path))
