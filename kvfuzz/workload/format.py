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

A workload is bounded before any token is derived: a file of at most :data:`MAX_WORKLOAD_BYTES`, at most
:data:`MAX_REQUESTS` requests, a prompt of at most :data:`MAX_PROMPT_TOKENS` (its prefix group's included) and all
prompts together at most :data:`MAX_WORKLOAD_PROMPT_TOKENS`, at most :data:`MAX_SAMPLES` samples, and every request
able to finish (arrive and generate its output) within the :data:`MAX_STEPS` steps a replay runs. Anything else is
refused with one line naming the request and the limit.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import random
from pathlib import Path
from typing import Any, Optional, Union

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

MAX_WORKLOAD_BYTES = 64 * 2**20
"""The largest workload file read (JSON or CSV): a hundred thousand requests with explicit prompts fit."""
MAX_REQUESTS = 100_000
"""Requests in one workload."""
MAX_STEPS = 100_000
"""The steps a replay runs at most (:class:`~kvfuzz.workload.scheduler.Scheduler`'s ``max_steps``): a request that
arrives later, or could not generate its output before, can never finish."""
MAX_PROMPT_TOKENS = 2**20
"""Tokens of one request's prompt, its prefix group's included."""
MAX_WORKLOAD_PROMPT_TOKENS = 2**22
"""Tokens of every prompt and prefix group of a workload together: replay holds them all in memory."""
MAX_SAMPLES = 256
"""Parallel samples of one request."""


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


Prompt = Union[Tokens, int]
"""A prompt as a workload gives it, before any token is derived: its tokens, or how many to derive."""


def _length(prompt: Prompt) -> int:
    return prompt if isinstance(prompt, int) else len(prompt)


def _prompt_length(value: Any, key: str, where: str, minimum: int) -> int:
    """A prompt length (``prompt_len``, a group's ``length``) checked, within :data:`MAX_PROMPT_TOKENS`."""
    length = _checked_int(value, key, where, minimum)
    if length > MAX_PROMPT_TOKENS:
        raise WorkloadError(f"{where}: {key!r} {length:,} is over the limit of {MAX_PROMPT_TOKENS:,} tokens per prompt")
    return length


def _groups(raw: Any) -> dict[str, Prompt]:
    """Each prefix group checked: its tokens, or the length to derive them by (none derived here)."""
    if not isinstance(raw, dict):
        raise WorkloadError("'prefix_groups' must be an object mapping group names to {length} or {tokens}")
    groups: dict[str, Prompt] = {}
    for name, spec in raw.items():
        where = f"prefix group {name!r}"
        if isinstance(spec, dict) and len(spec) == 1 and "tokens" in spec:
            groups[name] = _tokens(spec["tokens"], where)
        elif isinstance(spec, dict) and len(spec) == 1 and "length" in spec:
            groups[name] = _prompt_length(spec["length"], "length", where, 1)
        else:
            raise WorkloadError(f'{where}: expected {{"length": N}} or {{"tokens": [...]}}')
    return groups


def _derived_groups(groups: dict[str, Prompt]) -> dict[str, Tokens]:
    return {
        name: derived_tokens(f"group:{name}", prompt) if isinstance(prompt, int) else prompt
        for name, prompt in groups.items()
    }


@attrs.frozen
class _CheckedRequest:
    """A request entry with every field checked and within the limits, its own prompt not yet derived."""

    id: str
    arrival: int
    own: Prompt  # the request's own prompt tokens, or how many to derive from its id
    output_len: int
    samples: int
    cancel_at: Optional[int]
    namespace: Namespace
    group: Optional[str]

    def built(self, groups: dict[str, Tokens]) -> Request:
        own = derived_tokens(self.id, self.own) if isinstance(self.own, int) else self.own
        prompt = (groups[self.group] if self.group else ()) + own
        return Request(
            self.id, self.arrival, prompt, self.output_len, self.samples, self.cancel_at, self.namespace, self.group
        )


def _request(entry: Any, number: int, groups: dict[str, Prompt]) -> _CheckedRequest:
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
    own: Prompt = (
        _tokens(entry["prompt"], f"{where} 'prompt'")
        if "prompt" in entry
        else _prompt_length(entry["prompt_len"], "prompt_len", where, 0)
    )
    length = (_length(groups[group]) if group else 0) + _length(own)
    if not length:
        raise WorkloadError(f"{where}: the prompt is empty")
    if length > MAX_PROMPT_TOKENS:
        raise WorkloadError(
            f"{where}: its prompt of {length:,} tokens is over the limit of {MAX_PROMPT_TOKENS:,} tokens per prompt"
        )
    arrival = _int(entry, "arrival", where, 0)
    if arrival is None:
        raise WorkloadError(f"{where}: 'arrival' is required")
    if "output_len" not in entry:
        raise WorkloadError(f"{where}: 'output_len' is required (the tokens it generates, >= 1)")
    output_len = _checked_int(entry["output_len"], "output_len", where, 1)
    if arrival + output_len > MAX_STEPS:
        raise WorkloadError(
            f"{where}: arriving at step {arrival:,} and generating {output_len:,} tokens, it cannot finish within "
            f"the limit of {MAX_STEPS:,} steps a replay runs"
        )
    samples = _int_or(entry, "samples", where, 1, default=1)
    if samples > MAX_SAMPLES:
        raise WorkloadError(f"{where}: 'samples' {samples:,} is over the limit of {MAX_SAMPLES} samples per request")
    cancel_at = _int(entry, "cancel_at", where, 0)
    if cancel_at is not None and cancel_at < arrival:
        raise WorkloadError(f"{where}: 'cancel_at' {cancel_at} is before its 'arrival' {arrival}")
    namespace = entry.get("namespace", [])
    if not isinstance(namespace, list) or not all(isinstance(part, str) for part in namespace):
        raise WorkloadError(f"{where}: 'namespace' must be a list of strings")
    return _CheckedRequest(entry["id"], arrival, own, output_len, samples, cancel_at, tuple(namespace), group)


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
    check_request_count(len(raw), where)
    checked = [_request(entry, number, groups) for number, entry in enumerate(raw, start=1)]
    seen: set[str] = set()
    for request in checked:
        if request.id in seen:
            raise WorkloadError(f"{where}: request id {request.id!r} appears twice")
        seen.add(request.id)
    total = sum(map(_length, groups.values())) + sum(
        (_length(groups[request.group]) if request.group else 0) + _length(request.own) for request in checked
    )
    if total > MAX_WORKLOAD_PROMPT_TOKENS:
        raise WorkloadError(
            f"{where}: its prompts hold {total:,} tokens together, over the limit of "
            f"{MAX_WORKLOAD_PROMPT_TOKENS:,} tokens per workload"
        )
    derived = _derived_groups(groups)
    requests = sorted((request.built(derived) for request in checked), key=lambda request: request.arrival)
    return Workload(
        str(data.get("name", Path(where).stem)),
        origin,
        str(data.get("description", "")),
        tuple(requests),
        derived,
        provenance,
    )


def check_request_count(count: int, where: str) -> None:
    """A :class:`WorkloadError` if a workload of ``count`` requests is over :data:`MAX_REQUESTS`."""
    if count > MAX_REQUESTS:
        raise WorkloadError(f"{where}: {count:,} requests is over the limit of {MAX_REQUESTS:,} requests per workload")


def check_file_size(path: Path) -> None:
    """A :class:`WorkloadError` if the workload file at ``path`` is over :data:`MAX_WORKLOAD_BYTES`, before it is
    read (a file that cannot be examined is left to the reading, which says why)."""
    try:
        size = Path(path).stat().st_size
    except OSError:
        return
    if size > MAX_WORKLOAD_BYTES:
        raise WorkloadError(
            f"{path}: {size:,} bytes is over the limit of {MAX_WORKLOAD_BYTES // 2**20} MiB per workload file"
        )


def load_workload(path: Path) -> Workload:
    check_file_size(path)
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise WorkloadError(f"{path}: {error}") from error
    return parse_workload(data, str(path))
