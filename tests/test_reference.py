"""Tests of the contiguous reference: tags, generated K/V, attention, and the per-sequence contiguous store."""

from __future__ import annotations

import math

import pytest
import torch

from kvfuzz.reference import (
    ContiguousReference,
    ModelShape,
    attend,
    extend_tag,
    kv_for_tags,
    namespace_tag,
    prefix_tags,
    queries_for_tags,
)

SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# -- tags ------------------------------------------------------------------------------------------------------------


def test_tags_are_deterministic_and_in_range() -> None:
    tokens = [5, 1, 9, 9, 0, 3]
    first = prefix_tags(("lora",), tokens)
    assert first == prefix_tags(("lora",), list(tokens)) == prefix_tags(("lora",), iter(tokens))
    assert len(first) == len(tokens)
    assert all(isinstance(t, int) and 0 <= t < 1 << 63 for t in first)
    assert len(set(first)) == len(first)


def test_prefix_tags_chain_extend_tag_from_the_namespace_tag() -> None:
    tokens = [3, 1, 4, 1, 5]
    tag = namespace_tag(("a", "b"))
    expected = []
    for token in tokens:
        tag = extend_tag(tag, token)
        expected.append(tag)
    assert prefix_tags(("a", "b"), tokens) == expected


def test_a_tag_depends_on_the_whole_prefix() -> None:
    base = [7, 7, 7, 7, 7, 7]
    tags = prefix_tags((), base)
    for changed_at in range(len(base)):
        other = list(base)
        other[changed_at] = 8
        other_tags = prefix_tags((), other)
        assert other_tags[:changed_at] == tags[:changed_at]
        for p in range(changed_at, len(base)):
            assert other_tags[p] != tags[p], f"tag at {p} ignores token {changed_at}"


def test_a_tag_depends_on_token_order_and_position() -> None:
    assert prefix_tags((), [1, 2])[-1] != prefix_tags((), [2, 1])[-1]
    # The same token repeated gives a different tag at every position.
    assert len(set(prefix_tags((), [0] * 50))) == 50


@pytest.mark.parametrize(
    "ns1, ns2",
    [
        (("ab", "c"), ("a", "bc")),
        (("x",), ("x", "")),
        ((), ("",)),
        (("a", "b"), ("b", "a")),
        (("lora-1",), ("lora-2",)),
    ],
)
def test_tags_depend_on_namespace_part_boundaries(ns1, ns2) -> None:
    assert namespace_tag(ns1) != namespace_tag(ns2)
    tokens = [1, 2, 3, 4]
    tags1, tags2 = prefix_tags(ns1, tokens), prefix_tags(ns2, tokens)
    assert all(t1 != t2 for t1, t2 in zip(tags1, tags2))


def test_namespace_tag_depends_on_parts_not_container_type() -> None:
    assert namespace_tag(("a", "b")) == namespace_tag(["a", "b"])
    assert prefix_tags(("a", "b"), [1]) == prefix_tags(["a", "b"], [1])


# -- generated K/V -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_for_tags_shape_dtype_and_range(dtype: torch.dtype) -> None:
    shape = ModelShape(num_layers=3, num_kv_heads=2, num_query_heads=6, head_dim=16, dtype=dtype)
    tags = prefix_tags(("ns",), range(5))
    keys, values = kv_for_tags(tags, shape)
    for tensor in (keys, values):
        assert tensor.shape == (5, 3, 2, 16)
        assert tensor.dtype == dtype
        assert tensor.device.type == "cpu"
        assert torch.isfinite(tensor).all()
        assert (tensor >= -1).all() and (tensor <= 1).all()
    queries = queries_for_tags(tags, shape)
    assert queries.shape == (5, 3, 6, 16) and queries.dtype == dtype


def test_kv_rows_are_splitmix_of_tag_and_lane_computed_by_hand() -> None:
    """The generated values, checked against splitmix64's finaliser written out in plain integers: each of a row's
    values is lane i of its salt, ``(tag ^ (i * golden + salt)) mod 2**64`` mixed, its low 24 bits scaled to [-1, 1)."""
    from kvfuzz.reference import content

    mask = (1 << 64) - 1

    def by_hand(tag: int, salt: int, lane: int) -> float:
        x = (tag ^ ((lane * 0x9E3779B97F4A7C15 + salt) & mask)) & mask
        x ^= x >> 30
        x = (x * 0xBF58476D1CE4E5B9) & mask
        x ^= x >> 27
        x = (x * 0x94D049BB133111EB) & mask
        x ^= x >> 31
        return (x & 0xFFFFFF) / (1 << 23) - 1.0

    shape = ModelShape(num_layers=1, num_kv_heads=1, num_query_heads=1, head_dim=3)
    tags = [0, 1, (1 << 63) - 1, 0x123456789ABCDEF]
    keys, values = kv_for_tags(tags, shape)
    for row, tag in enumerate(tags):
        for lane in range(3):
            assert keys[row, 0, 0, lane].item() == by_hand(tag, content._SALT_K, lane)
            assert values[row, 0, 0, lane].item() == by_hand(tag, content._SALT_V, lane)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_for_tags_is_deterministic(dtype: torch.dtype) -> None:
    shape = ModelShape(dtype=dtype)
    tags = prefix_tags((), [4, 2, 4, 2, 9])
    k1, v1 = kv_for_tags(tags, shape)
    k2, v2 = kv_for_tags(list(tags), shape)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_tags_give_bit_identical_rows_wherever_they_sit_in_the_batch(dtype: torch.dtype) -> None:
    shape = ModelShape(dtype=dtype)
    t1, t2, t3 = prefix_tags(("x",), [1, 2, 3])
    keys, values = kv_for_tags([t1, t2, t1, t3, t1], shape)
    alone_k, alone_v = kv_for_tags([t1], shape)
    for row in (0, 2, 4):
        assert torch.equal(keys[row], alone_k[0]) and torch.equal(values[row], alone_v[0])
    # Bit for bit: compare the raw bits too (equal handles -0.0 == 0.0, which would hide a difference).
    assert torch.equal(
        keys[0].view(torch.int16 if dtype != torch.float32 else torch.int32),
        keys[2].view(torch.int16 if dtype != torch.float32 else torch.int32),
    )
    sub_k, sub_v = kv_for_tags([t3, t2], shape)
    assert torch.equal(sub_k[0], keys[3]) and torch.equal(sub_k[1], keys[1])
    assert torch.equal(sub_v[0], values[3]) and torch.equal(sub_v[1], values[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_different_tags_give_different_kv_and_k_differs_from_v(dtype: torch.dtype) -> None:
    shape = ModelShape(dtype=dtype)
    tags = prefix_tags(("ns",), range(20)) + prefix_tags(("other",), range(20))
    keys, values = kv_for_tags(tags, shape)
    flat_k = keys.reshape(len(tags), -1)
    flat_v = values.reshape(len(tags), -1)
    for i in range(len(tags)):
        assert not torch.equal(flat_k[i], flat_v[i])
        for j in range(i + 1, len(tags)):
            assert not torch.equal(flat_k[i], flat_k[j]), (i, j)
            assert not torch.equal(flat_v[i], flat_v[j]), (i, j)
    queries = queries_for_tags(tags, shape)
    assert not torch.equal(queries[:, :, : shape.num_kv_heads], keys)


def test_neighbouring_tags_differ_in_most_elements() -> None:
    """The values look random: consecutive tags do not give nearly equal rows."""
    keys, _ = kv_for_tags([1000, 1001], SHAPE)
    assert (keys[0] != keys[1]).float().mean() > 0.9
    assert keys.float().abs().mean() > 0.2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_values_are_the_float32_values_rounded(dtype: torch.dtype) -> None:
    tags = prefix_tags((), range(6))
    k32, v32 = kv_for_tags(tags, ModelShape(dtype=torch.float32))
    k, v = kv_for_tags(tags, ModelShape(dtype=dtype))
    assert torch.equal(k, k32.to(dtype)) and torch.equal(v, v32.to(dtype))


def test_kv_for_no_tags_is_empty() -> None:
    keys, values = kv_for_tags([], SHAPE)
    assert keys.shape == (0, *SHAPE.kv_row_shape) and values.shape == (0, *SHAPE.kv_row_shape)


def test_model_shape_rejects_query_heads_not_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError):
        ModelShape(num_kv_heads=3, num_query_heads=4)


# -- attention -------------------------------------------------------------------------------------------------------


def naive_attend(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths) -> torch.Tensor:
    """Grouped-query softmax attention, one sequence, layer and query head at a time, in float64.

    Query head h reads KV head h // (Hq / Hkv); only the first lengths[s] positions of sequence s count.
    """
    num_seqs, _, num_layers, kv_heads, head_dim = keys.shape
    query_heads = queries.shape[2]
    group = query_heads // kv_heads
    out = torch.zeros(num_seqs, num_layers, query_heads, head_dim, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(lengths[s])
        for layer in range(num_layers):
            for h in range(query_heads):
                kvh = h // group
                q = queries[s, layer, h].double()
                scores = []
                for p in range(n):
                    k = keys[s, p, layer, kvh].double()
                    scores.append(float((q * k).sum()) / math.sqrt(head_dim))
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                acc = torch.zeros(head_dim, dtype=torch.float64)
                for p in range(n):
                    acc += weights[p] / total * values[s, p, layer, kvh].double()
                out[s, layer, h] = acc
    return out


def random_inputs(lengths, num_layers, kv_heads, query_heads, head_dim, seed=0, dtype=torch.float32, pad=0.0):
    generator = torch.Generator().manual_seed(seed)
    num_seqs, longest = len(lengths), max(lengths)
    queries = torch.randn(num_seqs, num_layers, query_heads, head_dim, generator=generator)
    keys = torch.randn(num_seqs, longest, num_layers, kv_heads, head_dim, generator=generator)
    values = torch.randn(num_seqs, longest, num_layers, kv_heads, head_dim, generator=generator)
    for s, n in enumerate(lengths):
        keys[s, n:] = pad
        values[s, n:] = pad
    return queries.to(dtype), keys.to(dtype), values.to(dtype), torch.tensor(lengths)


GEOMETRIES = [  # (layers, kv heads, query heads, head dim)
    (1, 1, 1, 4),
    (2, 2, 4, 8),
    (3, 1, 4, 16),
    (2, 4, 4, 8),
    (1, 2, 8, 32),
]
BATCHES = [[1], [5], [1, 5, 3], [7, 7], [2, 9, 1, 4]]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=[f"L{g[0]}kv{g[1]}q{g[2]}d{g[3]}" for g in GEOMETRIES])
@pytest.mark.parametrize("lengths", BATCHES, ids=["-".join(map(str, b)) for b in BATCHES])
def test_attend_equals_a_naive_per_head_loop(geometry, lengths) -> None:
    queries, keys, values, lens = random_inputs(lengths, *geometry, seed=len(lengths) * 31 + geometry[2])
    got = attend(queries, keys, values, lens)
    assert got.shape == queries.shape and got.dtype == torch.float32
    expected = naive_attend(queries, keys, values, lens)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6), (got.double() - expected).abs().max()


def test_attend_over_one_position_returns_its_value() -> None:
    queries, keys, values, lens = random_inputs([1, 4], 2, 2, 4, 8)
    got = attend(queries, keys, values, lens)
    group = 2
    for h in range(4):
        assert torch.allclose(got[0, :, h], values[0, 0, :, h // group], rtol=0, atol=1e-6)


def test_attend_uses_the_kv_head_of_each_query_group() -> None:
    """With one position per KV head holding a distinct constant value, each query head returns its group's value."""
    queries = torch.randn(1, 1, 6, 4)
    keys = torch.randn(1, 3, 1, 3, 4)
    values = torch.zeros(1, 3, 1, 3, 4)
    for kvh in range(3):
        values[0, :, 0, kvh] = float(kvh + 1)
    got = attend(queries, keys, values, torch.tensor([3]))
    for h in range(6):
        assert torch.allclose(got[0, 0, h], torch.full((4,), float(h // 2 + 1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_accepts_low_precision_inputs_and_returns_float32(dtype: torch.dtype) -> None:
    queries, keys, values, lens = random_inputs([3, 6], 2, 2, 4, 8, dtype=dtype)
    got = attend(queries, keys, values, lens)
    assert got.dtype == torch.float32
    expected = naive_attend(queries.float(), keys.float(), values.float(), lens)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("garbage", [0.0, 1e4, -3.5, 1e-30])
def test_padding_positions_do_not_change_the_result(garbage: float) -> None:
    lengths = [2, 6, 4]
    clean = random_inputs(lengths, 2, 2, 4, 8, seed=7, pad=0.0)
    dirty = random_inputs(lengths, 2, 2, 4, 8, seed=7, pad=garbage)
    assert torch.equal(clean[0], dirty[0])
    assert torch.equal(attend(*clean), attend(*dirty))


def test_more_padding_does_not_change_the_result() -> None:
    queries, keys, values, lens = random_inputs([2, 5], 2, 2, 4, 8, seed=3)
    base = attend(queries, keys, values, lens)
    extra = torch.randn(2, 4, 2, 2, 8)
    padded = attend(queries, torch.cat([keys, extra], 1), torch.cat([values, extra], 1), lens)
    assert torch.allclose(base, padded, rtol=1e-6, atol=1e-7)


def test_each_row_of_a_padded_batch_equals_the_row_attended_alone() -> None:
    lengths = [3, 8, 1, 5]
    queries, keys, values, lens = random_inputs(lengths, 2, 2, 4, 8, seed=11)
    batched = attend(queries, keys, values, lens)
    for s, n in enumerate(lengths):
        alone = attend(queries[s : s + 1], keys[s : s + 1, :n], values[s : s + 1, :n], lens[s : s + 1])
        assert torch.allclose(batched[s : s + 1], alone, rtol=1e-6, atol=1e-7)


def test_attend_depends_on_every_valid_position() -> None:
    queries, keys, values, lens = random_inputs([6], 1, 1, 1, 8, seed=5)
    base = attend(queries, keys, values, lens)
    for p in range(6):
        changed = values.clone()
        changed[0, p] += 1.0
        assert not torch.allclose(attend(queries, keys, changed, lens), base, atol=1e-7)


# -- the contiguous reference ---------------------------------------------------------------------------------------


def expected_kv(namespace, tokens, shape=SHAPE):
    return kv_for_tags(prefix_tags(namespace, tokens), shape)


def assert_matches_tags(ref: ContiguousReference, seq: str, namespace, tokens) -> None:
    assert ref.namespace(seq) == namespace
    assert ref.tokens(seq) == list(tokens)
    assert ref.tags(seq) == prefix_tags(namespace, tokens)
    keys, values = expected_kv(namespace, tokens, ref.shape)
    assert ref.keys(seq).shape == keys.shape and ref.keys(seq).dtype == ref.shape.dtype
    assert torch.equal(ref.keys(seq), keys)
    assert torch.equal(ref.values(seq), values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_and_extend_keep_kv_equal_to_the_tags(dtype: torch.dtype) -> None:
    ref = ContiguousReference(ModelShape(dtype=dtype))
    ref.add("a", ("lora",), [1, 2, 3])
    assert "a" in ref and "b" not in ref
    assert_matches_tags(ref, "a", ("lora",), [1, 2, 3])
    new_tags = ref.extend("a", [4, 5])
    assert new_tags == prefix_tags(("lora",), [1, 2, 3, 4, 5])[3:]
    assert_matches_tags(ref, "a", ("lora",), [1, 2, 3, 4, 5])
    assert ref.extend("a", []) == []
    assert_matches_tags(ref, "a", ("lora",), [1, 2, 3, 4, 5])


def test_equal_prefixes_under_different_namespaces_hold_different_kv() -> None:
    ref = ContiguousReference(SHAPE)
    ref.add("x", ("ab", "c"), [1, 2, 3])
    ref.add("y", ("a", "bc"), [1, 2, 3])
    ref.add("z", ("ab", "c"), [1, 2, 3])
    assert torch.equal(ref.keys("x"), ref.keys("z"))
    for p in range(3):
        assert not torch.equal(ref.keys("x")[p], ref.keys("y")[p])


def test_fork_copies_and_branches_are_independent() -> None:
    ref = ContiguousReference(SHAPE)
    ref.add("p", ("n",), [1, 2, 3])
    ref.fork("p", "c")
    assert_matches_tags(ref, "c", ("n",), [1, 2, 3])
    ref.extend("c", [9])
    ref.extend("p", [8, 8])
    assert_matches_tags(ref, "c", ("n",), [1, 2, 3, 9])
    assert_matches_tags(ref, "p", ("n",), [1, 2, 3, 8, 8])
    ref.truncate("p", 1)
    assert_matches_tags(ref, "c", ("n",), [1, 2, 3, 9])


@pytest.mark.parametrize("length", [1, 3, 5, 6])
def test_truncate_then_extend(length: int) -> None:
    ref = ContiguousReference(SHAPE)
    tokens = [4, 8, 15, 16, 23, 42]
    ref.add("s", (), tokens)
    ref.truncate("s", length)
    assert_matches_tags(ref, "s", (), tokens[:length])
    ref.extend("s", [7, 7])
    assert_matches_tags(ref, "s", (), tokens[:length] + [7, 7])


def test_remove_forgets_only_that_sequence() -> None:
    ref = ContiguousReference(SHAPE)
    ref.add("a", (), [1, 2])
    ref.add("b", (), [3])
    ref.remove("a")
    assert "a" not in ref and "b" in ref
    with pytest.raises(KeyError):
        ref.keys("a")
    assert_matches_tags(ref, "b", (), [3])
    ref.add("a", ("new",), [5])  # the id may be reused
    assert_matches_tags(ref, "a", ("new",), [5])


def test_queries_are_those_of_each_last_tag() -> None:
    ref = ContiguousReference(SHAPE)
    ref.add("a", (), [1, 2, 3])
    ref.add("b", ("x",), [4])
    expected = queries_for_tags([ref.tags("a")[-1], ref.tags("b")[-1]], SHAPE)
    assert torch.equal(ref.queries(["a", "b"]), expected)
    assert ref.queries(["a", "b"]).shape == (2, SHAPE.num_layers, SHAPE.num_query_heads, SHAPE.head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_equals_attend_of_the_same_data(dtype: torch.dtype) -> None:
    shape = ModelShape(num_layers=2, num_kv_heads=2, num_query_heads=4, head_dim=8, dtype=dtype)
    ref = ContiguousReference(shape)
    sequences = {"a": ((), [1, 2, 3, 4, 5, 6, 7]), "b": (("l",), [9]), "c": (("l", "s"), [3, 3, 3])}
    for seq, (namespace, tokens) in sequences.items():
        ref.add(seq, namespace, tokens)
    order = ["c", "a", "b"]
    queries = ref.queries(order)
    got = ref.attention(order, queries)

    lengths = [len(sequences[s][1]) for s in order]
    keys = torch.zeros(3, max(lengths), *shape.kv_row_shape, dtype=dtype)
    values = torch.zeros_like(keys)
    for row, seq in enumerate(order):
        k, v = expected_kv(*sequences[seq], shape)
        keys[row, : lengths[row]], values[row, : lengths[row]] = k, v
    expected = attend(queries, keys, values, torch.tensor(lengths))
    assert torch.equal(got, expected)
    naive = naive_attend(queries, keys, values, lengths)
    assert torch.allclose(got.double(), naive, rtol=1e-5, atol=1e-6)
    # Each row equals that sequence attended alone.
    for row, seq in enumerate(order):
        alone = ref.attention([seq], queries[row : row + 1])
        assert torch.allclose(got[row : row + 1], alone, rtol=1e-6, atol=1e-7)


def test_attention_follows_truncation_and_fork() -> None:
    ref = ContiguousReference(SHAPE)
    ref.add("p", (), [1, 2, 3, 4])
    ref.fork("p", "c")
    ref.extend("c", [5, 6])
    ref.truncate("p", 2)
    queries = ref.queries(["p", "c"])
    got = ref.attention(["p", "c"], queries)
    fresh = ContiguousReference(SHAPE)
    fresh.add("p", (), [1, 2])
    fresh.add("c", (), [1, 2, 3, 4, 5, 6])
    assert torch.equal(queries, fresh.queries(["p", "c"]))
    assert torch.equal(got, fresh.attention(["p", "c"], queries))
