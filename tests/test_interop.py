"""Other zarr v3 implementations read what ucpformat writes, and ucpformat reads what they
write: tensorstore (C++) and zarr-python (with ucpformat's data-type plugin)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorstore as ts
import zarr

import ucpformat
from tests.helpers import random_array, read_json
from ucpformat.checkpoint import commit as protocol
from ucpformat.checkpoint import tree
from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, default_producer
from ucpformat.engine.write import write_object
from ucpformat.errors import CheckpointExistsError, MissingChunkError, WriteError
from ucpformat.format import dtypes
from ucpformat.format.dtypes import BY_NAME, DATA_TYPES, DataType
from ucpformat.store import LocalStore

SHAPE = (13, 7)
COMPRESSIONS = [None, "zstd", "gzip", "blosc"]
LAYOUTS = ["unsharded", "sharded"]


def raw(a: Any) -> tuple[str, tuple[int, ...], bytes]:
    """dtype name, shape and bytes: tensorstore and zarr return their own dtype objects."""
    arr = np.asarray(a)
    return (str(arr.dtype), arr.shape, np.ascontiguousarray(arr).tobytes())


def _save(path: Path, dt: DataType, layout: str, compression: str | None) -> np.ndarray[Any, Any]:
    arr = random_array(np.random.default_rng(3), dt, SHAPE)
    kw: dict[str, Any] = {}
    if layout == "sharded":  # several shards, partial edge chunks and shards
        kw = {"chunk_bytes": 8 * dt.itemsize, "shard_bytes": 40 * dt.itemsize}
    ucpformat.save(path, {"model": {"x": arr}}, compression=compression, durable=False, **kw)
    meta = ucpformat.open(path).arrays["model/x"]
    assert (meta.shard_shape is not None) == (layout == "sharded")
    return arr


def _ts_open(path: Path) -> Any:
    return ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}},
                   read=True).result()


# -- ucpformat writes, others read ---------------------------------------------------------


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dt", DATA_TYPES, ids=lambda d: d.name)
def test_tensorstore_reads_ucpformat_bit_exactly(
    tmp_path: Path, dt: DataType, layout: str, compression: str | None
) -> None:
    arr = _save(tmp_path / "c", dt, layout, compression)
    t = _ts_open(tmp_path / "c" / "model" / "x")
    assert str(t.dtype.name) == dt.name
    assert raw(t.read().result()) == raw(arr)
    assert raw(t[3:11, 1::2].read().result()) == raw(arr[3:11, 1::2])


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dt", DATA_TYPES, ids=lambda d: d.name)
def test_zarr_python_reads_ucpformat_bit_exactly(
    tmp_path: Path, dt: DataType, layout: str, compression: str | None
) -> None:
    arr = _save(tmp_path / "c", dt, layout, compression)
    z = zarr.open_array(tmp_path / "c" / "model" / "x", mode="r")
    assert z.dtype == dt.numpy
    assert raw(z[...]) == raw(arr)
    assert raw(z[2:9, ::3]) == raw(arr[2:9, ::3])


def test_zarr_python_opens_the_whole_hierarchy(tmp_path: Path, small_state: dict[str, Any]) -> None:
    ucpformat.save(tmp_path / "c", small_state, durable=False)
    root = zarr.open_group(tmp_path / "c", mode="r")
    assert root.attrs["ucp"]["version"] == "1.0"
    w = root["model/fc.weight"]
    assert isinstance(w, zarr.Array)
    assert raw(w[...]) == raw(small_state["model"]["fc.weight"])
    assert raw(root["model/emb.weight"][...]) == raw(small_state["model"]["emb.weight"])


# -- others write, ucpformat reads (adopt commits their arrays) ------------------------------


def _ts_compressor(name: str | None, dt: DataType) -> list[dict[str, Any]]:
    if name is None:
        return []
    if name == "zstd":
        return [{"name": "zstd", "configuration": {"level": 3}}]
    if name == "gzip":
        return [{"name": "gzip", "configuration": {"level": 5}}]
    return [{"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle",
                                                 "typesize": dt.itemsize, "blocksize": 0}}]


def _bytes_codec(dt: DataType) -> dict[str, Any]:
    # 1-byte types have no byte order: tensorstore refuses "endian" for them
    if dt.itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


def _ts_write(path: Path, arr: np.ndarray[Any, Any], dt: DataType, layout: str,
              compression: str | None, **extra: Any) -> None:
    chain = [_bytes_codec(dt), *_ts_compressor(compression, dt), {"name": "crc32c"}]
    if layout == "sharded":
        grid = [6, 4]
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": [2, 2],
            "codecs": chain,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}},
                             {"name": "crc32c"}],
        }}]
    else:
        grid = [4, 3] if arr.ndim else []
        codecs = chain
    metadata = {
        "shape": list(arr.shape),
        "data_type": dt.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
        "chunk_key_encoding": {"name": "default"},
        "fill_value": dtypes.fill_value_to_json(dt, tree.zero_bits(dt)),
        "codecs": codecs,
    }
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)},
                 "metadata": metadata, "create": True, **extra}).result()
    t.write(arr).result()
    if dt.name == "float8_e8m0fnu":
        # tensorstore 0.1.86 writes float8_e8m0fnu fill values back as wrong JSON numbers
        # (0x00, i.e. 2**-127, becomes 0.0; 0x7f, i.e. 1.0, becomes 2**64); the data are
        # right. Put the fill value back as the raw bits it was given.
        doc = read_json(path / "zarr.json")
        doc["fill_value"] = metadata["fill_value"]
        (path / "zarr.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dt", DATA_TYPES, ids=lambda d: d.name)
def test_ucpformat_reads_tensorstore_bit_exactly(
    tmp_path: Path, dt: DataType, layout: str, compression: str | None
) -> None:
    ckpt = tmp_path / "c"
    arr = random_array(np.random.default_rng(5), dt, SHAPE)
    scalar = random_array(np.random.default_rng(6), dt, ())
    _ts_write(ckpt / "model" / "x", arr, dt, layout, compression,
              store_data_equal_to_fill_value=True)
    _ts_write(ckpt / "model" / "s", scalar, dt, "unsharded", compression,
              store_data_equal_to_fill_value=True)
    result = ucpformat.adopt(ckpt, values={"training": {"step": 7}}, durable=False)
    assert result.tensors == 2
    c = ucpformat.open(ckpt)
    assert c.values() == {"training": {"step": 7}}
    assert (c.arrays["model/x"].shard_shape is not None) == (layout == "sharded")
    assert raw(c["model/x"].read()) == raw(arr)
    assert raw(c["model/x"][1:12:3, ::-1]) == raw(arr[1:12:3, ::-1])
    assert raw(c["model/s"].read()) == raw(scalar)
    report = ucpformat.validate(ckpt, deep=True)
    assert report.valid and not report.warnings, report.to_json()
    # the adopted (canonically rewritten) metadata is still what tensorstore reads
    assert raw(_ts_open(ckpt / "model" / "x").read().result()) == raw(arr)


def test_ucpformat_reads_zarr_python_with_the_plugin(tmp_path: Path) -> None:
    import ml_dtypes
    from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec

    x = (np.arange(70).reshape(10, 7) / 7).astype(ml_dtypes.bfloat16)
    z = zarr.create_array(tmp_path / "c" / "model" / "w", shape=x.shape, dtype=x.dtype,
                          chunks=(2, 3), shards=(4, 6), serializer=BytesCodec(),
                          compressors=[ZstdCodec(level=3), Crc32cCodec()], fill_value=0,
                          config={"write_empty_chunks": True}, zarr_format=3)
    z[:] = x
    ucpformat.adopt(tmp_path / "c", durable=False)
    assert raw(ucpformat.open(tmp_path / "c")["model/w"].read()) == raw(x)


def test_adopt_refuses_missing_chunks_unless_sparse(tmp_path: Path) -> None:
    """tensorstore (like zarr-python) skips chunks equal to the fill value by default: such
    an array cannot be adopted as dense, because a reader could not tell "all zeros" from
    "never written"; declared sparse, the absent chunks read as fill values."""
    dt = BY_NAME["float32"]
    arr = np.zeros(SHAPE, np.float32)
    arr[0, 0] = 1.0
    _ts_write(tmp_path / "c" / "model" / "x", arr, dt, "unsharded", None)
    with pytest.raises(MissingChunkError) as info:
        ucpformat.adopt(tmp_path / "c", durable=False)
    assert info.value.rule == "UCP-1.0-R030" and info.value.tensor == "model/x"
    assert "model/x/c/" in str(info.value)
    assert not (tmp_path / "c" / "zarr.json").exists()

    ucpformat.adopt(tmp_path / "c", attributes={"model/x": {"ucp": {"sparse": True}}},
                    durable=False)
    c = ucpformat.open(tmp_path / "c")
    assert c["model/x"].attributes["sparse"] is True
    assert raw(c["model/x"].read()) == raw(arr)
    assert ucpformat.validate(tmp_path / "c", deep=True).valid


def test_adopt_refuses_foreign_files_and_committed_checkpoints(tmp_path: Path) -> None:
    dt = BY_NAME["int32"]
    arr = np.arange(91, dtype=np.int32).reshape(SHAPE)
    _ts_write(tmp_path / "c" / "model" / "x", arr, dt, "sharded", None)
    (tmp_path / "c" / "notes.txt").write_text("hello")
    with pytest.raises(WriteError) as info:
        ucpformat.adopt(tmp_path / "c", durable=False)
    assert info.value.rule == "UCP-1.0-R044" and "notes.txt" in str(info.value)
    (tmp_path / "c" / "notes.txt").unlink()
    ucpformat.adopt(tmp_path / "c", durable=False)
    with pytest.raises(CheckpointExistsError) as info2:
        ucpformat.adopt(tmp_path / "c", durable=False)
    assert info2.value.rule == "UCP-1.0-R053"


# -- fill-value and codec traps ------------------------------------------------------------


def test_bfloat16_hex_fill_value_is_bfloat16_bits(tmp_path: Path) -> None:
    """"0x3f80" is bfloat16 1.0 (float16 parsing would give 1.875): for ucpformat, for
    zarr-python with the plugin, and for tensorstore."""
    import ml_dtypes

    dt = BY_NAME["bfloat16"]
    meta = ArrayMeta(path="model/x", shape=(4, 6), dtype=dt, chunk_shape=(2, 3), shard_shape=None,
                     compression=None, fill_value=ml_dtypes.bfloat16(1.0),
                     attributes={"ucp": {"sparse": True}})
    store = LocalStore(tmp_path / "c", durable=False)
    protocol.prepare_destination(store, overwrite=False)
    objects = [write_object(store, meta, (0, 0), np.full((2, 3), 5, ml_dtypes.bfloat16))]
    protocol.commit_checkpoint(store, arrays=[meta], groups=[GroupMeta("model")], objects=objects,
                  root_ucp={"producer": default_producer()})
    assert read_json(tmp_path / "c" / "model" / "x" / "zarr.json")["fill_value"] == "0x3f80"

    expected = np.ones((4, 6), ml_dtypes.bfloat16)
    expected[:2, :3] = 5
    assert raw(ucpformat.open(tmp_path / "c")["model/x"].read()) == raw(expected)
    z = zarr.open_array(tmp_path / "c" / "model" / "x", mode="r")
    assert float(z.fill_value) == 1.0
    assert raw(z[...]) == raw(expected)
    t = _ts_open(tmp_path / "c" / "model" / "x")
    assert raw(t.read().result()) == raw(expected)


def test_fill_values_parsed_once_stay_those_of_their_type_and_exact_value() -> None:
    """An open parses each array's fill value through one cache: -0.0 stays apart from 0.0,
    1 from 1.0, a hex string of one type from the same string of another, and a refused
    value is refused every time."""
    f32, i8 = BY_NAME["float32"], BY_NAME["int8"]
    bf16, f16 = BY_NAME["bfloat16"], BY_NAME["float16"]
    for _ in range(2):
        assert np.signbit(dtypes.fill_value_from_json(f32, -0.0))
        assert not np.signbit(dtypes.fill_value_from_json(f32, 0.0))
        assert float(dtypes.fill_value_from_json(bf16, "0x3f80")) == 1.0
        assert float(dtypes.fill_value_from_json(f16, "0x3f80")) == 1.875
        assert dtypes.fill_value_from_json(i8, 1).dtype == np.int8
        for bad, dt in ((1.0, i8), (1000, i8), ("0x3f8", bf16), (True, f32)):
            with pytest.raises(ucpformat.errors.FormatError):
                dtypes.fill_value_from_json(dt, bad)


@pytest.mark.parametrize("dt", DATA_TYPES, ids=lambda d: d.name)
def test_bytes_codec_declares_endian_only_for_multibyte_types(tmp_path: Path, dt: DataType) -> None:
    x = random_array(np.random.default_rng(1), dt, (9,))
    ucpformat.save(tmp_path / "c", {"model": {"x": x}}, chunk_bytes=2 * dt.itemsize, durable=False)
    doc = read_json(tmp_path / "c" / "model" / "x" / "zarr.json")
    chain = doc["codecs"][0]["configuration"]["codecs"]
    if dt.itemsize == 1:
        assert chain[0] == {"name": "bytes"}
    else:
        assert chain[0] == {"name": "bytes", "configuration": {"endian": "little"}}


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "bfloat16"])
def test_zarr_python_plugin_writes_what_tensorstore_reads(tmp_path: Path, name: str) -> None:
    """zarr-python with the plugin writes no "endian" for 1-byte types (tensorstore refuses
    it) and the right type name (float8_e4m3fn, never float8_e4m3)."""
    from zarr.codecs import Crc32cCodec

    dt = BY_NAME[name]
    x = random_array(np.random.default_rng(2), dt, (6,))
    z = zarr.create_array(tmp_path / "a", shape=x.shape, dtype=dt.numpy, chunks=(6,),
                          compressors=[Crc32cCodec()], fill_value=0, zarr_format=3)
    z[:] = x
    doc = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert doc["data_type"] == name
    if dt.itemsize == 1:
        assert "configuration" not in doc["codecs"][0] or "endian" not in doc["codecs"][0][
            "configuration"]
    assert raw(_ts_open(tmp_path / "a").read().result()) == raw(x)


def test_unrepresentable_fill_value_is_refused_never_misread(tmp_path: Path) -> None:
    """float8_e8m0fnu has no zero: a fill value of 0.0 (what tensorstore 0.1.86 writes for
    the bits 0x00) is refused by name, not silently turned into NaN."""
    dt = BY_NAME["float8_e8m0fnu"]
    arr = random_array(np.random.default_rng(4), dt, SHAPE)
    _ts_write(tmp_path / "c" / "model" / "x", arr, dt, "unsharded", None,
              store_data_equal_to_fill_value=True)
    node = tmp_path / "c" / "model" / "x" / "zarr.json"
    node.write_text(json.dumps({**read_json(node), "fill_value": 0.0}))
    with pytest.raises(ucpformat.errors.FormatError) as info:
        ucpformat.adopt(tmp_path / "c", durable=False)
    # R036 (a JSON number for float8_e8m0fnu is a power of two) refines R026
    assert info.value.rule == "UCP-1.0-R036" and info.value.tensor == "model/x"
