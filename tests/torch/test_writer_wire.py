"""The writer process's messages as JSON (ucpformat.torch.writer_wire): every object that
travels comes back equal from its JSON form through the message bytes, and what has no
JSON form is refused in the parent with a message that says what to pass instead."""

from __future__ import annotations

import errno
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")

from ucpformat.checkpoint.options import SaveOptions
from ucpformat.distributed.comm import SingleProcess
from ucpformat.distributed.pipeline import DistributedSaveResult
from ucpformat.distributed.rank_description import (
    MeshPosition,
    MeshTensor,
    TensorSpec,
)
from ucpformat.errors import (
    CheckpointExistsError,
    InvalidValueError,
    StorageError,
    WriteError,
)
from ucpformat.layout.dtensor import Replicate, Shard, StridedShard
from ucpformat.store import ArchiveStore, LocalStore, open_store
from ucpformat.store.fsspec_store import FsspecStore
from ucpformat.torch.comm import GlooConnector
from ucpformat.torch.writer_process import WriterProcess
from ucpformat.torch.writer_wire import (
    FragmentPlace,
    SaveRequest,
    connector_from_json,
    connector_to_json,
    decode_message,
    encode_message,
    error_from_json,
    error_to_json,
    location_from_json,
    location_to_json,
    request_to_json,
    result_from_json,
    result_to_json,
    save_kwargs_to_json,
)

pytestmark = pytest.mark.torch


def _wire(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` through the socket's bytes (a message of its own)."""
    return decode_message(encode_message({"kind": "test", "doc": doc}))["doc"]


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # a traceback, as in the child
        return caught


# -- the request ------------------------------------------------------------------------------


def test_a_request_comes_back_equal(tmp_path: Path) -> None:
    specs = [TensorSpec("model/w", (4, 6), "bfloat16", {"layout": {"tp_dim": 0}}),
             TensorSpec("optimizer/state/w/step", (), "int64")]
    meshes = [MeshPosition("dp", (2,), (1,)), MeshPosition("tp x dp", (2, 4), (0, 3))]
    on_mesh = [MeshTensor("model/w", "tp x dp", (Shard(0), StridedShard(1, 2))),
               MeshTensor("model/b", "dp", (Replicate(),))]
    groups = {"optimizer": {"values": {"lr": np.float32(0.5), "betas": (0.9, 0.99),
                                       "eps": math.inf}}}
    metadata = {"run": "x", "step": np.int64(7), "loss": math.nan}
    options = SaveOptions(compression={"name": "zstd", "configuration": {"level": 3}},
                          workers=3, durable=False, progress=True, min_shard_bytes=0)
    doc = request_to_json(
        tmp_path / "ck", specs=specs, fragments=[], group_attributes=groups, meshes=meshes,
        on_mesh=on_mesh, metadata=metadata, save_kwargs={"options": options, "overwrite": True})
    got = SaveRequest.from_json(_wire(doc))
    assert got.location == str(tmp_path / "ck")
    assert got.specs == specs and got.meshes == meshes and got.on_mesh == on_mesh
    assert got.group_attributes == {"optimizer": {"values": {
        "lr": 0.5, "betas": [0.9, 0.99], "eps": math.inf}}}  # as a save stores them
    assert got.metadata is not None and got.metadata["step"] == 7
    assert math.isnan(got.metadata["loss"])
    assert got.save_kwargs == {"options": options, "overwrite": True}
    bare = SaveRequest.from_json(_wire(request_to_json("s3://b/p", specs=[], fragments=[])))
    assert (bare.group_attributes, bare.metadata, bare.save_kwargs) == (None, None, {})
    assert bare.location == "s3://b/p"  # a URL is text: the child opens it


@pytest.mark.parametrize("dtype", [np.dtype("<f4"), np.dtype(">i4"), np.dtype(bool),
                                   np.dtype(ml_dtypes.bfloat16),
                                   np.dtype(ml_dtypes.float8_e4m3fn), np.dtype("<c8")])
def test_a_fragment_is_the_same_view_of_the_arena(dtype: np.dtype[Any]) -> None:
    arena = np.zeros(4096, dtype=np.uint8)
    arena[:] = np.random.default_rng(1).integers(0, 256, arena.size)
    whole = np.ndarray((6, 5), dtype=dtype, buffer=arena, offset=64)
    view = whole[1:5:2, ::-2]  # strided, negative strides: a view as it lies
    offset = view.__array_interface__["data"][0] - arena.ctypes.data
    place = FragmentPlace("model/w", ((1, 5), (0, 3)), offset, view.shape, view.strides,
                          view.dtype)
    back = FragmentPlace.from_json(_wire(place.to_json()))
    assert back == place
    again = np.ndarray(back.shape, dtype=back.dtype, buffer=arena, offset=back.offset,
                       strides=back.strides)
    assert again.dtype == view.dtype and again.tobytes() == view.tobytes()


def test_a_data_type_outside_the_format_is_refused() -> None:
    place = FragmentPlace("model/w", ((0, 1),), 0, (1,), (8,), np.dtype("datetime64[s]"))
    with pytest.raises(WriteError, match="closed list"):
        place.to_json()


def test_options_travel_and_a_callback_is_refused() -> None:
    kwargs = {"workers": 4, "compression": "zstd", "progress": True, "chunk_bytes": 1 << 16}
    assert SaveRequest.from_json(_wire(request_to_json(
        "x", specs=[], fragments=[], save_kwargs=kwargs))).save_kwargs == kwargs

    def report(n: int) -> None: ...

    with pytest.raises(InvalidValueError, match=r"progress=report .*progress=True"):
        save_kwargs_to_json({"progress": report})
    with pytest.raises(InvalidValueError, match=r"SaveOptions\.progress=report"):
        save_kwargs_to_json({"options": SaveOptions(progress=report)})
    with pytest.raises(InvalidValueError, match=r"metadata cannot be sent .* JSON"):
        request_to_json("x", specs=[], fragments=[], metadata={"when": object()})
    with pytest.raises(InvalidValueError, match=r"root_values cannot be sent"):
        save_kwargs_to_json({"root_values": {"t": {1, 2}}})


# -- locations --------------------------------------------------------------------------------


def test_paths_and_plain_stores_travel(tmp_path: Path) -> None:
    assert location_from_json(_wire(location_to_json(tmp_path / "a"))) == str(tmp_path / "a")
    store = LocalStore(tmp_path / "b", durable=False, follow_link=False)
    back = location_from_json(_wire(location_to_json(store)))
    assert type(back) is LocalStore

    def settings(s: Any) -> dict[str, Any]:  # what a store keeps, less what it holds
        return {k: v for k, v in vars(s).items() if k not in ("_lock", "_held")}

    assert settings(back) == settings(store)  # a setting the JSON form lacks fails here


def test_an_fsspec_store_travels_as_its_url_and_options() -> None:
    pytest.importorskip("fsspec")
    store = open_store("memory://bucket/ck")
    assert isinstance(store, FsspecStore)
    doc = _wire(location_to_json(store))
    assert doc == {"kind": "fsspec", "url": "memory://bucket/ck",
                   "storage_options": {"use_listings_cache": False}}
    back = location_from_json(doc)
    assert isinstance(back, FsspecStore) and type(back.fs) is type(store.fs)
    assert (back.location, back.root) == (store.location, store.root)
    odd = FsspecStore("memory://bucket/ck", storage_options={"hook": object()})
    with pytest.raises(InvalidValueError, match=r"storage options .* JSON.*pass a path or URL"):
        location_to_json(odd)
    bare = FsspecStore("bucket/ck", fs=store.fs)  # no protocol: its URL says nothing
    with pytest.raises(InvalidValueError, match="cannot be rebuilt from its URL"):
        location_to_json(bare)


class _FullDisk(LocalStore):
    def create(self, key: str, buffers: Any, *, atomic: bool = False) -> int:
        raise OSError(errno.ENOSPC, "No space left on device", key)


def test_other_stores_are_refused_with_what_to_pass(tmp_path: Path) -> None:
    for store in (_FullDisk(tmp_path / "a"), ArchiveStore(tmp_path / "b.ucpz")):
        with pytest.raises(InvalidValueError,
                           match=f"a {type(store).__name__} cannot be sent to the writer "
                                 "process.*pass a path or URL") as info:
            location_to_json(store)
        assert info.value.path == store.location
    with pytest.raises(WriteError, match="no location of kind 'pickle'"):
        location_from_json({"kind": "pickle"})


# -- connectors, results, errors ---------------------------------------------------------------


def test_a_gloo_connector_travels_and_another_is_refused() -> None:
    gloo = GlooConnector("node0.example", 29517, 3, 8, timeout_s=60.0)
    doc = _wire(connector_to_json(gloo) or {})
    assert doc["kind"] == "gloo" and connector_from_json(doc) == gloo
    assert connector_to_json(None) is None and connector_from_json(None) is None

    class Mine:
        def connect(self) -> SingleProcess:
            return SingleProcess()

    for odd in (Mine(), type("Gloo2", (GlooConnector,), {})("h", 1, 0, 1)):
        with pytest.raises(InvalidValueError, match=f"a {type(odd).__name__} cannot be sent"
                                                    ".*GlooConnector"):
            connector_to_json(odd)
        with pytest.raises(InvalidValueError, match="cannot be sent"):
            WriterProcess(odd)  # refused before a process starts
    with pytest.raises(WriteError, match="no connector of kind 'x'"):
        connector_from_json({"kind": "x"})


def test_a_result_comes_back_equal() -> None:
    result = DistributedSaveResult("/ck/7", 12, 30, 1 << 40, 5)
    assert result_from_json(_wire(result_to_json(result))) == result


def test_a_ucp_error_keeps_its_class_and_fields() -> None:
    for exc in (CheckpointExistsError("/ck is committed", rule="UCP-1.0-R053", path="/ck"),
                StorageError("disk gone", tensor="model/w")):
        doc = _wire(error_to_json(_raised(exc)))
        back = error_from_json(doc, 4321)
        assert type(back) is type(exc)
        assert (back.message, back.rule, back.path, back.tensor) == \
            (exc.message, exc.rule, exc.path, exc.tensor)
        assert back.__notes__[0].startswith("in the writer process (pid 4321):\nTraceback")


class _Custom(RuntimeError):
    pass


def test_another_error_is_a_write_error_naming_its_class_and_message() -> None:
    cases = [(OSError(errno.EFBIG, "File too large"), "OSError: [Errno 27] File too large"),
             (KeyError("model/w"), "KeyError: 'model/w'"),
             (_Custom("boom"), f"{__name__}._Custom: boom")]
    for exc, named in cases:
        back = error_from_json(_wire(error_to_json(_raised(exc))), 99)
        assert type(back) is WriteError
        assert back.message == f"the writer process failed: {named}"
        note = back.__notes__[0]
        assert "(pid 99)" in note and "_raised" in note  # the child's traceback


def test_a_message_that_is_not_one_is_refused() -> None:
    for data in (b"\x80\x04K\x01.", b"[1, 2]", b'{"no": "kind"}'):  # a pickle, no object
        with pytest.raises(WriteError, match=r"not JSON|no kind"):
            decode_message(data)
