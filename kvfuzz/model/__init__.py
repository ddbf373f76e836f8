"""A tiny transformer language model that keeps its K/V in kvfuzz's paged pools, to check end to end that paging
leaves a model's output unchanged."""
