"""The contiguous reference: what every position's K/V must be, and attention computed without paging."""

from kvfuzz.reference.attention import attend
from kvfuzz.reference.content import ModelShape, extend_tag, kv_for_tags, namespace_tag, prefix_tags, queries_for_tags
from kvfuzz.reference.contiguous import ContiguousReference

__all__ = [
    "ContiguousReference",
    "ModelShape",
    "attend",
    "extend_tag",
    "kv_for_tags",
    "namespace_tag",
    "prefix_tags",
    "queries_for_tags",
]
