"""How the engine tells KV-cache groups apart (``Capabilities.kv_groups``): a group's K/V are those of the request's
namespace with one more part naming the group, so that no two groups' K/V agree, and reports show that part as the
group's name."""

from __future__ import annotations

from kvfuzz.allocator.types import Namespace, SeqId

GROUP_MARK = "\x00kv-group:"
"""The start of the namespace part that makes a KV-cache group's K/V differ from every other group's (other
layers); no namespace the machine draws holds it."""


def group_seq(seq: SeqId, group_name: str) -> SeqId:
    """The id of ``seq``'s table in the KV-cache group ``group_name`` (never an id the machine draws)."""
    return f"{seq}@{group_name}"


def group_namespace(namespace: Namespace, group_name: str) -> Namespace:
    """The namespace whose K/V stand for ``group_name``'s layers: ``namespace`` with one more part."""
    return (*namespace, GROUP_MARK + group_name)


def group_of(namespace: Namespace) -> str:
    """The KV-cache group whose K/V ``namespace`` stands for ("" for a sequence's own namespace)."""
    return namespace[-1][len(GROUP_MARK) :] if namespace and namespace[-1].startswith(GROUP_MARK) else ""


def shown_namespace(namespace: Namespace) -> str:
    """``namespace`` as reports show it: a group's K/V as the request's namespace and the group's name."""
    group = group_of(namespace)
    return f"{namespace[:-1]!r} in group {group}" if group else repr(namespace)
