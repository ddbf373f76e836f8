"""The features the fields of :class:`~kvfuzz.allocator.types.Capabilities` belong to, each field's documentation as
its metadata, and what is rendered from it: the class's docstring and the capability table of docs/contract.md.

Each field's meaning is written once, in its metadata (:func:`documented`); the docstring (:func:`docstring`) and the
table (:func:`capability_table`, written into docs/contract.md by ``scripts/samples.py``) are generated from it, and
``tests/test_contract_v2.py`` fails when the page and the fields disagree. Texts use markdown's single backticks for
code; the docstring shows them as reStructuredText's double backticks.
"""

from __future__ import annotations

import enum
import re
import textwrap
from typing import Any, Iterable, Mapping, Optional

import attrs


class Feature(enum.Enum):
    """A feature: the capabilities that describe one part of a serving engine, listed together."""

    SCHEDULING = "Scheduling and preemption"
    SCHEDULED_WRITES = "The in-flight window and scheduled writes"
    PREFIX_CACHE = "Prefix cache and eviction policy"
    FORKS = "Forks and copies"
    SPECULATIVE = "Speculative decoding and look-ahead"
    HOST_TIER = "Host tier: swap, a host cache and asynchronous loads"
    GROUPS = "KV-cache groups and sliding windows"
    OBSERVATION = "Introspection and the allocator's own attention"


FEATURE_INTROS: Mapping[Feature, str] = {
    Feature.SCHEDULING: "What the engine's scheduler does with running sequences, and when an allocator may refuse.",
    Feature.SCHEDULED_WRITES: (
        "When released blocks may be reused, and what a block whose writes are scheduled but not yet computed may "
        "serve. Three behaviours follow from a block becoming matchable as soon as the writes that fill it are "
        "scheduled (vLLM hashes blocks at allocation; kvfuzz 0.1 declared the three together as "
        "`matchable_when_scheduled`): `hits_scheduled_writes`, `shares_scheduled_blocks` and "
        "`free_lands_scheduled_writes`."
    ),
    Feature.PREFIX_CACHE: "Cached blocks: how they are matched, remapped and evicted, and two policies.",
    Feature.FORKS: "Sequences sharing blocks with a fork, and the copies that break the sharing.",
    Feature.SPECULATIVE: "Drafts rolled back, and blocks allocated ahead of the tokens.",
    Feature.HOST_TIER: "The host pool of `num_host_blocks` blocks: swap's destination, or a second cache tier.",
    Feature.GROUPS: "Attention that reads only a window of positions, and several block tables per sequence.",
    Feature.OBSERVATION: "What an allocator lets kvfuzz look at beyond the contract's operations.",
}
"""Feature -> what its capabilities describe, shown before its fields."""

CAPABILITY_DOC = "kvfuzz.capability"
"""The metadata key of a field's :class:`CapabilityDoc`."""


@attrs.frozen
class CapabilityDoc:
    """One capability's documentation: the feature it belongs to, what declaring it means, who declares it, and the
    section of docs/contract.md (an anchor, ``#...``) or the page that details it (None: the row says it all)."""

    feature: Feature
    meaning: str
    declared_by: str
    details: Optional[str] = None


def documented(feature: Feature, meaning: str, declared_by: str, details: Optional[str] = None) -> dict[str, Any]:
    """The metadata of a ``Capabilities`` field: ``attrs.field(..., metadata=documented(...))``."""
    return {CAPABILITY_DOC: CapabilityDoc(feature, meaning, declared_by, details)}


def _doc(field: attrs.Attribute) -> CapabilityDoc:
    doc = field.metadata.get(CAPABILITY_DOC)
    if not isinstance(doc, CapabilityDoc):
        raise ValueError(f"capability {field.name!r} has no documentation in its metadata (documented(...))")
    return doc


def by_feature(fields: Iterable[attrs.Attribute]) -> dict[Feature, list[attrs.Attribute]]:
    """The fields of each feature, features in :class:`Feature`'s order and fields in declaration order."""
    fields = list(fields)
    grouped: dict[Feature, list[attrs.Attribute]] = {feature: [] for feature in Feature}
    for field in fields:
        grouped[_doc(field).feature].append(field)
    return {feature: members for feature, members in grouped.items() if members}


def _default(field: attrs.Attribute) -> str:
    return repr(field.default)


def _rst(text: str) -> str:
    return re.sub(r"`([^`]+)`", r"``\1``", text)


def docstring(summary: str, fields: Iterable[attrs.Attribute]) -> str:
    """The class docstring: ``summary``, then every field by feature, with its default, meaning and who declares it."""
    paragraphs = [summary, "Every field, by feature (the capability table of docs/contract.md shows the same text):"]
    for feature, members in by_feature(fields).items():
        paragraphs.append(f"{feature.value}. {_rst(FEATURE_INTROS[feature])}")
        for field in members:
            doc = _doc(field)
            paragraphs.append(
                f"``{field.name}`` (default {_default(field)}): {_rst(doc.meaning)}. Who declares it: "
                f"{_rst(doc.declared_by)}."
            )
    wrapped = [
        textwrap.fill(paragraph, width=116, break_long_words=False, break_on_hyphens=False) for paragraph in paragraphs
    ]
    return "\n\n".join(wrapped) + "\n"


def _details(doc: CapabilityDoc) -> str:
    if doc.details is None:
        return ""
    label = "below" if doc.details.startswith("#") else doc.details
    return f" ([{label}]({doc.details}))"


def capability_table(fields: Iterable[attrs.Attribute]) -> str:
    """The capability table of docs/contract.md: one table per feature, each field's default, meaning (with a link to
    the section that details it) and who declares it."""
    blocks = []
    for feature, members in by_feature(fields).items():
        rows = [
            textwrap.fill(
                f"**{feature.value}.** {FEATURE_INTROS[feature]}",
                width=120,
                break_long_words=False,
                break_on_hyphens=False,
            ),
            "",
            "| field | default | what declaring it means | who declares it |",
            "|---|---|---|---|",
        ]
        for field in members:
            doc = _doc(field)
            rows.append(f"| `{field.name}` | {_default(field)} | {doc.meaning}{_details(doc)} | {doc.declared_by} |")
        blocks.append("\n".join(rows))
    return "\n\n".join(blocks) + "\n"
