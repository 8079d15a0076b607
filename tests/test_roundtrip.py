"""Round trips: every data type, odd shapes and chunkings, compression, slices, state trees."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import ucpformat
from tests.helpers import assert_bits_equal, random_array
from ucpformat.checkpoint import commit as protocol
from ucpformat.checkpoint import tree, writer
from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, default_producer
from ucpformat.engine.compression import Compression
from ucpformat.format import names
from ucpformat.format.dtypes import DATA_TYPES, DataType
from ucpformat.store import LocalStore

COMPRESSIONS = [None, "zstd", "gzip", "blosc"]
DIMS = [0, 1, 2, 3, 5, 7, 11, 13]
MAX_ELEMENTS = 1500

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- arrays -----------------------------------------------------------------------------


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    rank = draw(st.integers(0, 4))
    shape = tuple(draw(st.sampled_from(DIMS)) for _ in range(rank))
    while math.prod(shape) > MAX_ELEMENTS:
        shape = tuple(max(1, s // 2) for s in shape)
    return shape


@st.composite
def index_for(draw: st.DrawFn, shape: tuple[int, ...]) -> Any:
    """A basic numpy index: ints (now and then out of range), slices with any step and
    sign, possibly an Ellipsis."""
    parts: list[Any] = []
    for n in shape:
        if draw(st.integers(0, 3)) == 0:
            parts.append(draw(st.integers(-n - 1, n) if draw(st.integers(0, 9)) == 0
                              else st.integers(-n, max(-n, n - 1))))
            continue
        bound = st.one_of(st.none(), st.integers(-n - 2, n + 2))
        step = draw(st.sampled_from([None, 1, 2, 3, 5, -1, -2, -3]))
        parts.append(slice(draw(bound), draw(bound), step))
    if draw(st.booleans()):  # an Ellipsis standing for parts[a:b]; the rest align at the end
        a = draw(st.integers(0, len(parts)))
        b = draw(st.integers(a, len(parts)))
        index: Any = (*parts[:a], Ellipsis, *parts[b:])
    else:  # trailing parts left out (numpy takes them whole)
        index = tuple(parts[: draw(st.integers(0, len(parts)))])
    if len(index) == 1 and draw(st.booleans()):
        index = index[0]  # a bare int / slice / Ellipsis
    return index


def _unsharded_multichunk(
    path: Path, arr: np.ndarray[Any, Any], dt: DataType, chunk: tuple[int, ...],
    compression: str | None,
) -> None:
    """Write ``arr`` as an unsharded array of several chunks (``save`` never makes one;
    other writers do) with the writer's own object encoder and commit."""
    meta = ArrayMeta(
        path="model/x", shape=arr.shape, dtype=dt, chunk_shape=chunk, shard_shape=None,
        compression=Compression.parse(compression, dt), fill_value=tree.zero_bits(dt),
    )
    store = LocalStore(path, durable=False)
    protocol.prepare_destination(store, overwrite=False)
    objects = writer.write_arrays(store, [(meta, arr)], hash_algorithm="sha256")
    protocol.commit_checkpoint(store, arrays=[meta], groups=[GroupMeta("model")], objects=objects,
                  root_ucp={"producer": default_producer()})


@st.composite
def array_cases(draw: st.DrawFn) -> dict[str, Any]:
    dt = draw(st.sampled_from(DATA_TYPES))
    shape = draw(shapes())
    seed = draw(st.integers(0, 2**32 - 1))
    layout = draw(st.sampled_from(["save", "save", "unsharded-chunks"]))
    chunk_bytes = draw(st.one_of(st.integers(1, 16), st.integers(1, 512), st.just(1 << 20)))
    shard_bytes = draw(st.one_of(st.integers(1, 256), st.integers(1, 4096), st.just(1 << 30)))
    chunk = tuple(draw(st.integers(1, max(1, s // 2 + 1))) for s in shape)
    compression = draw(st.sampled_from(COMPRESSIONS))
    indexes = draw(st.lists(index_for(shape), min_size=1, max_size=4))
    return {
        "dt": dt, "shape": shape, "seed": seed, "layout": layout, "chunk_bytes": chunk_bytes,
        "shard_bytes": shard_bytes, "chunk": chunk, "compression": compression,
        "indexes": indexes,
    }


@settings(SETTINGS, max_examples=300)
@given(case=array_cases())
def test_arrays_round_trip_bit_exactly_with_any_slice(case: dict[str, Any]) -> None:
    dt: DataType = case["dt"]
    arr = random_array(np.random.default_rng(case["seed"]), dt, case["shape"])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        if case["layout"] == "save":
            ucpformat.save(path, {"model": {"x": arr}}, compression=case["compression"],
                           chunk_bytes=case["chunk_bytes"], shard_bytes=case["shard_bytes"],
                           durable=False, workers=2)
        else:
            _unsharded_multichunk(path, arr, dt, case["chunk"], case["compression"])
        with ucpformat.open(path, workers=2) as ckpt:
            t = ckpt["model/x"]
            assert t.shape == arr.shape and t.meta.dtype is dt
            m = t.meta
            event("sharded" if m.shard_shape else f"unsharded, {m.object_count} chunk(s)")
            if m.shard_shape and any(s % e for s, e in zip(m.shape, m.shard_shape, strict=True)):
                event("partial shard")
            assert_bits_equal(t.read(), arr)
            for index in case["indexes"]:
                try:
                    expected = arr[index]
                except IndexError:
                    with pytest.raises(IndexError):
                        t[index]  # a SelectionError naming the tensor
                    continue
                assert_bits_equal(t[index], expected)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("dt", DATA_TYPES, ids=lambda d: d.name)
def test_every_dtype_round_trips_sharded_with_partial_chunks_and_shards(
    tmp_path: Path, dt: DataType, compression: str | None
) -> None:
    """Deterministic coverage of every type x compressor on the hard layout: several shards,
    the last ones partial, with partial inner edge chunks."""
    arr = random_array(np.random.default_rng(7), dt, (13, 7, 3))
    ucpformat.save(tmp_path / "c", {"model": {"x": arr, "s": arr[0, 0, 0]}}, durable=False,
                   compression=compression, chunk_bytes=8 * dt.itemsize,
                   shard_bytes=40 * dt.itemsize)
    ckpt = ucpformat.open(tmp_path / "c")
    meta = ckpt.arrays["model/x"]
    assert meta.shard_shape is not None
    assert any(s % c for s, c in zip(meta.shape, meta.chunk_shape, strict=True))
    assert any(s % c for s, c in zip(meta.shape, meta.shard_shape, strict=True))
    assert math.prod(meta.object_grid) > 1
    assert (meta.compression.name if meta.compression else None) == compression
    assert_bits_equal(ckpt["model/x"].read(), arr)
    assert_bits_equal(ckpt["model/x"][::-2, 1:, -1], arr[::-2, 1:, -1])
    assert ckpt["model/s"].shape == ()
    assert_bits_equal(ckpt["model/s"].read(), arr[0, 0, 0])


def test_odd_shapes_round_trip(tmp_path: Path) -> None:
    state = {
        "model": {
            "scalar": np.float32(-0.0),
            "empty": np.zeros((0,), np.float32),
            "empty2": np.zeros((3, 0, 2), np.int8),
            "prime": np.arange(7 * 11 * 13, dtype=np.int16).reshape(7, 11, 13),
            "nan": np.array([np.nan, -np.nan, np.inf, -0.0], np.float64),
        }
    }
    ucpformat.save(tmp_path / "c", state, chunk_bytes=64, shard_bytes=512, durable=False)
    ckpt = ucpformat.open(tmp_path / "c")
    for name, value in state["model"].items():
        assert_bits_equal(ckpt.tensor("model", name).read(), np.asarray(value))
    assert_bits_equal(ckpt["model/empty2"][1:, :, ::-1], state["model"]["empty2"][1:, :, ::-1])
    # empty arrays store no objects, and need none
    assert not (tmp_path / "c" / "model" / "empty" / "c").exists()
    assert ucpformat.validate(tmp_path / "c", deep=True).valid


def test_big_endian_input_is_stored_little_endian(tmp_path: Path) -> None:
    arr = np.arange(12, dtype=">f4").reshape(3, 4)
    ucpformat.save(tmp_path / "c", {"model": {"x": arr}}, durable=False)
    out = ucpformat.open(tmp_path / "c")["model/x"].read()
    assert out.dtype == np.dtype("<f4")
    assert np.array_equal(out, arr)


def test_blosc_shuffles_with_the_declared_typesize(tmp_path: Path) -> None:
    """The blosc header must carry the type size the metadata declares, or the shuffle
    filter works on single bytes (a no-op) whatever the configuration says."""
    arr = np.linspace(0, 1, 4096, dtype=np.float32)
    ucpformat.save(tmp_path / "c", {"model": {"x": arr}}, compression="blosc", durable=False)
    meta = ucpformat.open(tmp_path / "c").arrays["model/x"]
    assert meta.compression is not None and meta.compression.configuration["typesize"] == 4
    chunk = (tmp_path / "c" / "model" / "x" / "c" / "0").read_bytes()
    assert chunk[3] == 4  # blosc header byte 3: typesize


# -- whole states ------------------------------------------------------------------------

SPECIAL_NAMES = ["a/b", "..", ".", "...", "__x", "_y", "語彙", "x" * 200, "%2E", "a b", "ß", "~",
                 "c", "W", "é" * 20, "zarr.json", "ZARR.json", "-", "0",
                 "$ucp_float"]
RESERVED_GROUPS = ("model", "optimizer", "training")


def _valid_node_name(name: str) -> bool:
    try:
        names.escape(name)
    except ucpformat.errors.InvalidNameError:
        return False
    return True


node_names = st.one_of(st.sampled_from(SPECIAL_NAMES), st.text(min_size=1, max_size=12)).filter(
    _valid_node_name
)
json_keys = st.text(max_size=8).filter(lambda k: k != "$ucp_float")
json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=10),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(json_keys, children, max_size=4)
    ),
    max_leaves=12,
)
small_arrays = st.builds(
    lambda dt, shape, seed: random_array(np.random.default_rng(seed), dt, shape),
    st.sampled_from(DATA_TYPES),
    st.lists(st.sampled_from([0, 1, 2, 3]), max_size=3).map(tuple),
    st.integers(0, 2**16),
)


def _unique_nodes(d: dict[str, Any]) -> dict[str, Any]:
    """Drop siblings whose node names collide ignoring case (the writer refuses them)."""
    seen: set[str] = set()
    out = {}
    for k, v in d.items():
        folded = names.escape(k).lower()
        if folded not in seen:
            seen.add(folded)
            out[k] = v
    return out


states = st.recursive(
    st.dictionaries(node_names, st.one_of(small_arrays, json_values), max_size=4).map(
        _unique_nodes),
    lambda children: st.dictionaries(node_names, st.one_of(children, small_arrays, json_values),
                                     max_size=4).map(_unique_nodes),
    max_leaves=10,
).filter(
    lambda d: not any(names.escape(k).lower().endswith(".ucp.json") for k in d)
    and all(isinstance(d[g], dict) for g in RESERVED_GROUPS if g in d)
)


def _same(a: Any, b: Any) -> bool:
    """Equality of decoded states: arrays bit-exact, floats by bits (NaN, -0.0), types kept."""
    if isinstance(b, np.ndarray | np.generic):
        return isinstance(a, np.ndarray) and ucpformat_bits(a) == ucpformat_bits(np.asarray(b))
    if type(a) is not type(b):
        return False
    if isinstance(b, float):
        if math.isnan(b):
            return math.isnan(a)
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in b)
    if isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _names_json_value(state: dict[str, Any], key: str) -> bool:
    """True if some mapping of ``state`` has a JSON value (not a node) named ``key``."""
    for k, v in state.items():
        if isinstance(v, dict) and _names_json_value(v, key):
            return True
        if k == key and not isinstance(v, np.ndarray | np.generic | dict):
            return True
        if k == key and isinstance(v, dict) and not tree._has_array(v):
            return True
    return False


def ucpformat_bits(a: np.ndarray[Any, Any]) -> tuple[Any, ...]:
    return (a.dtype.str, a.shape, a.tobytes())


@SETTINGS
@given(state=states)
def test_nested_states_round_trip_through_to_dict(state: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            ucpformat.save(Path(tmp) / "c", state, durable=False, workers=2)
        except ucpformat.errors.InvalidValueError as exc:
            # a JSON value named $ucp_float would make its group's values a reserved object
            assert exc.rule == "UCP-1.0-R070" and "$ucp_float" in str(exc), exc
            assert _names_json_value(state, "$ucp_float"), state
            event("refused: JSON value named $ucp_float")
            return
        back = ucpformat.open(Path(tmp) / "c").to_dict()
    assert _same(back, state), (back, state)


def test_json_value_named_like_the_float_tag_is_refused(tmp_path: Path) -> None:
    for state in ({"$ucp_float": {}}, {"training": {"x": {"$ucp_float": "NaN"}}},
                  {"a": np.zeros(2), "$ucp_float": 1}):
        with pytest.raises(ucpformat.errors.InvalidValueError, match=r"\$ucp_float") as info:
            ucpformat.save(tmp_path / "c", state, durable=False)
        assert info.value.rule == "UCP-1.0-R070"
        assert not (tmp_path / "c").exists()
    # as a node name (a group or an array) it is an ordinary name
    ucpformat.save(tmp_path / "d", {"$ucp_float": {"w": np.ones(2)}}, durable=False)
    back = ucpformat.open(tmp_path / "d").to_dict()
    assert back["$ucp_float"]["w"].tolist() == [1.0, 1.0]


def test_special_names_and_values_round_trip(tmp_path: Path) -> None:
    a = np.arange(3, dtype=np.int64)
    state = {
        "model": {n: a + i for i, n in enumerate(["a/b", "..", ".", "__x", "語彙", "x" * 200])},
        "training": {"nan": float("nan"), "inf": float("inf"), "ninf": -float("inf"),
                     "neg0": -0.0, "big": 2**64, "語": ["é", None, True, {"k": []}]},
    }
    ucpformat.save(tmp_path / "c", state, durable=False)
    ckpt = ucpformat.open(tmp_path / "c")
    assert _same(ckpt.to_dict(), state)
    assert ckpt.tensor("model", "..").path == "model/%2E%2E"
    assert (tmp_path / "c" / "model" / "%2E%2E" / "zarr.json").is_file()
    assert (tmp_path / "c" / "model" / "a%2Fb").is_dir()
    assert ckpt.tensor("model", "__x").path == "model/%5F_x"


@pytest.mark.parametrize("tag", [{}, [], 1, None, "nan"])
def test_malformed_float_tag_in_a_checkpoint_is_a_format_error(tag: Any) -> None:
    from ucpformat.format import jsonvalues

    with pytest.raises(ucpformat.errors.FormatError, match="malformed non-finite float") as info:
        jsonvalues.decode({"$ucp_float": tag}, where="values")
    assert info.value.rule == "UCP-1.0-R070"
