"""ucpformat.megatron's geometry and ShardedObject encoding, without megatron processes."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ucpformat.errors import FormatError, InvalidValueError, LayoutError, LoadError, WriteError
from ucpformat.layout.semantics import TensorLayout
from ucpformat.megatron.directory import BesideFiles
from ucpformat.megatron.regions import locate, megatron_map, stored_shape, tensor_name
from ucpformat.store import open_store

QKV = TensorLayout.from_json({"tp": {"dim": 0}, "groups": 2, "parts": [
    {"name": "q", "size": 8}, {"name": "k", "size": 4}, {"name": "v", "size": 4}]})
VOCAB = TensorLayout.from_json({"tp": {"dim": 0}, "vocab": {"dim": 0}})


def fill(lmap: object, stored: np.ndarray) -> np.ndarray:
    out = np.full(lmap.local_shape, -1.0)  # type: ignore[attr-defined]
    for piece in lmap.pieces:  # type: ignore[attr-defined]
        out[tuple(slice(a, b) for a, b in piece.local)] = stored[
            tuple(slice(a, b) for a, b in piece.glob)]
    return out


def test_global_layer_and_expert_indices_are_inserted() -> None:
    assert tensor_name("decoder.layers.mlp.linear_fc2.weight", (3,)) == (
        "decoder.layers.3.mlp.linear_fc2.weight")
    assert tensor_name("decoder.layers.mlp.experts.experts.linear_fc1.weight", (1, 5)) == (
        "decoder.layers.1.mlp.experts.experts.5.linear_fc1.weight")
    assert tensor_name("embedding.word_embeddings.weight", ()) == (
        "embedding.word_embeddings.weight")
    with pytest.raises(LayoutError, match="expert"):
        tensor_name("decoder.layers.mlp.linear_fc1.weight", (1, 2))


def test_master_copies_share_one_stored_name() -> None:
    for state in ("param", "fp32_param"):
        loc = locate(f"optimizer.state.{state}.decoder.layers.linear.weight", (2,))
        assert loc.path == "optimizer/state/decoder.layers.2.linear.weight/master_param"
        assert loc.param_path == "model/decoder.layers.2.linear.weight"
    assert locate("optimizer.state.exp_avg.a.b", ()).state == "exp_avg"
    assert locate("a.b", ()).state is None


def test_qkv_is_group_interleaved_in_megatron_and_part_major_stored() -> None:
    """Stored [q (2 groups x 4 rows); k (2 x 2); v (2 x 2)]; Megatron's global tensor is
    [q_0; k_0; v_0; q_1; k_1; v_1]."""
    stored = np.arange(16 * 3, dtype=float).reshape(16, 3)
    q, k, v = stored[:8], stored[8:12], stored[12:]
    want = np.concatenate([q[:4], k[:2], v[:2], q[4:], k[2:], v[2:]])
    got = fill(megatron_map((16, 3), QKV, (16, 3), tensor="qkv"), stored)
    assert np.array_equal(got, want)
    # a TP2 rank's fragment (group 1) is a sub-box of Megatron's tensor
    half = megatron_map((16, 3), QKV, (16, 3), tensor="qkv").sub_box(((8, 16), (0, 3)))
    assert np.array_equal(fill(half, stored), want[8:])


def test_vocabulary_padding_is_dropped_and_maps_to_nothing() -> None:
    assert stored_shape((128, 4), VOCAB, 100, tensor="emb") == (100, 4)
    lmap = megatron_map((100, 4), VOCAB, (128, 4), tensor="emb")
    assert sum(math.prod(b - a for a, b in p.local) for p in lmap.pieces) == 400
    with pytest.raises(LayoutError, match="vocab_size"):
        stored_shape((128, 4), VOCAB, None, tensor="emb")
    with pytest.raises(LayoutError, match="R113"):
        stored_shape((128, 4), VOCAB, 200, tensor="emb")
    with pytest.raises(LayoutError, match="fewer"):
        megatron_map((100, 4), VOCAB, (64, 4), tensor="emb")


def test_megatrons_files_are_hidden_and_protected(tmp_path: Path) -> None:
    (tmp_path / "common.pt").write_bytes(b"x")
    store = BesideFiles(open_store(tmp_path, durable=False))
    store.put("zarr.json", [b"{}"])
    assert sorted(store.list()) == ["zarr.json"]
    with pytest.raises(WriteError, match=r"common\.pt"):
        store.put("common.pt", [b"y"])
    with pytest.raises(WriteError, match=r"metadata\.json"):
        store.delete_keys(["zarr.json", "metadata.json"])
    store.delete_all()
    assert [p.name for p in tmp_path.iterdir()] == ["common.pt"]


torch = pytest.importorskip("torch")


def test_objects_are_json_and_arrays_and_come_back_alike() -> None:
    from ucpformat.megatron import objects

    value = {"a": (1, 2.5, float("inf")), "t": torch.arange(3), "n": [np.ones(2), "s"]}
    enc = objects.encode("k/shard_0_1", value, allow_opaque=False)
    assert enc.opaque is None
    assert enc.value == {"a": [1, 2.5, float("inf")], "t": None, "n": [None, "s"]}
    assert [(p, kind) for p, _, kind in enc.tensors] == [("/t", "torch"), ("/n/0", "numpy")]
    back = objects.decode("k/shard_0_1", enc.value,
                          {p: (a, kind) for p, a, kind in enc.tensors}, value)
    assert back["a"] == (1, 2.5, float("inf"))
    assert torch.equal(back["t"], value["t"]) and isinstance(back["n"][0], np.ndarray)
    with pytest.raises(FormatError, match="no place"):
        objects.decode("k", {"t": 1}, {"/x": (np.ones(1), "numpy")}, None)


def test_an_object_that_is_not_json_is_refused_unless_opted_in() -> None:
    from ucpformat.megatron import objects

    with pytest.raises(InvalidValueError, match=r"'k/shard_0_1'.*allow_opaque"):
        objects.encode("k/shard_0_1", {"x": object()}, allow_opaque=False)
    with pytest.raises(InvalidValueError, match="'k/shard_0_1'"):
        objects.encode("k/shard_0_1", b"bytes", allow_opaque=False)
    enc = objects.encode("k/shard_0_1", {"x": {1, 2}}, allow_opaque=True)
    assert enc.opaque is not None
    raw = objects.opaque_array(enc.opaque)
    with pytest.raises(LoadError, match="runs code"):
        objects.load_opaque("k/shard_0_1", raw, allow_opaque=False)
    assert objects.load_opaque("k/shard_0_1", raw, allow_opaque=True) == {"x": {1, 2}}


@pytest.mark.parametrize(("stored", "tensors", "live", "where"), [
    ([1, 2], {}, {"a": 1, "b": 2}, "'/'"),                 # a dict stored as a list
    ({"a": "x"}, {}, {"a": 1}, "'/a'"),                    # a number stored as a string
    ({"a": [1]}, {}, {"a": {"b": 1}}, "'/a'"),
    ({"t": 3}, {}, {"t": torch.zeros(2)}, "'/t'"),         # a tensor stored as a value
    ({"t": None}, {"/t": (np.ones(2), "numpy")}, {"t": 1.5}, "'/t'"),
])
def test_a_sharded_object_of_another_json_kind_is_refused(
    stored: object, tensors: dict, live: object, where: str
) -> None:
    """Before: a ShardedObject whose stored value had another JSON type than the live
    object (a dict stored as a list) was handed to Megatron unchecked."""
    from ucpformat.megatron import objects

    with pytest.raises(LoadError, match=rf"'k/shard_0_1' at {where}.*refused"):
        objects.decode("k/shard_0_1", stored, tensors, live)
    # None on either side says nothing; tuples and lists are both arrays
    assert objects.decode("k", {"a": None}, {}, {"a": 3}) == {"a": None}
    assert objects.decode("k", [1, 2], {}, (0, 0)) == (1, 2)
    assert objects.decode("k", {"a": 1.5}, {}, {"a": np.float32(1)}) == {"a": 1.5}


def test_register_keeps_the_two_opaque_opt_ins_apart() -> None:
    """Before: register(allow_opaque=True), an opt-in to store opaque objects, also made the
    registered load strategy unpickle them."""
    pytest.importorskip("megatron.core")
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        get_default_strategy,
    )

    import ucpformat.megatron as um

    um.register({"num_attention_heads": 2}, backend="ucp-test-opt-ins", allow_opaque=True)
    load = get_default_strategy(StrategyAction.LOAD_SHARDED, "ucp-test-opt-ins", 1)
    save = get_default_strategy(StrategyAction.SAVE_SHARDED, "ucp-test-opt-ins", 1)
    assert save.allow_opaque and not load.allow_opaque
    um.register(backend="ucp-test-opt-ins", unpickle_opaque=True)
    assert get_default_strategy(StrategyAction.LOAD_SHARDED, "ucp-test-opt-ins", 1).allow_opaque
