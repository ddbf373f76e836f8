"""kvfuzz: a correctness and fuzz-testing harness for paged KV-cache allocators."""

__version__ = "0.1.0"
