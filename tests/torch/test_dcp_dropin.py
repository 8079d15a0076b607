"""The DCP plugin as a drop-in for FileSystemWriter/FileSystemReader: the public behaviour
PyTorch's own DCP tests check, run once with DCP's storage and once with UCP swapped in
(ucpformat.testing.dcp_dropin); the one difference left is documented in docs/dcp.md."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner  # noqa: E402
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION  # noqa: E402
from torch.distributed.checkpoint.format_utils import torch_save_to_dcp  # noqa: E402

import ucpformat  # noqa: E402
from ucpformat.testing.dcp_dropin import filesystem_storage_swapped  # noqa: E402
from ucpformat.torch.dcp import UCPReader, UCPWriter  # noqa: E402

pytestmark = [pytest.mark.torch,
              pytest.mark.filterwarnings("ignore::UserWarning")]  # DCP: no process group


@pytest.fixture(params=["filesystem", "ucp"])
def storage(request: pytest.FixtureRequest) -> Iterator[str]:
    """DCP's own file-system storage, or the UCP plugin in its place."""
    cm = filesystem_storage_swapped() if request.param == "ucp" else contextlib.nullcontext()
    with cm:
        yield request.param


def _sd() -> dict[str, torch.Tensor]:
    return {"a": torch.arange(16, dtype=torch.float32).reshape(4, 4)}


def test_auto_detection_picks_the_plugin_and_refuses_unknown_urls(
    storage: str, tmp_path: Path
) -> None:
    dcp.save(_sd(), checkpoint_id=tmp_path / "first")
    loaded = {"a": torch.zeros(4, 4)}
    dcp.load(loaded, checkpoint_id=tmp_path / "first")
    assert torch.equal(loaded["a"], _sd()["a"])
    if storage == "ucp":  # what DCP picked is a UCP checkpoint
        assert ucpformat.validate(tmp_path / "first").valid
    with pytest.raises(RuntimeError, match="Cannot detect"):
        dcp.save(_sd(), checkpoint_id="abc://abc.abc")
    with pytest.raises(RuntimeError, match="Cannot detect"):
        dcp.load(loaded, checkpoint_id="abc://abc.abc")


def test_validate_checkpoint_id(tmp_path: Path) -> None:
    assert UCPWriter.validate_checkpoint_id("some/dir")
    assert UCPWriter.validate_checkpoint_id(Path("some/dir"))
    assert UCPWriter.validate_checkpoint_id("file:///tmp/x")
    ucpformat.save(tmp_path / "ckpt", {"model": {"w": np.zeros(3, np.float32)}})
    assert UCPReader.validate_checkpoint_id(tmp_path / "ckpt")  # only where one is
    assert UCPReader.validate_checkpoint_id(f"file://{tmp_path / 'ckpt'}")
    assert not UCPReader.validate_checkpoint_id(tmp_path)
    for cls in (UCPWriter, UCPReader):
        assert cls.validate_checkpoint_id("memory://bucket/x")  # a protocol fsspec has
        assert not cls.validate_checkpoint_id("abc://abc.abc")
        assert not cls.validate_checkpoint_id("")


def test_already_exists_in_filesystem_writers_words(storage: str, tmp_path: Path) -> None:
    dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(tmp_path))
    with pytest.raises(dcp.api.CheckpointException, match="Checkpoint already exists"):
        dcp.save(_sd(), storage_writer=dcp.FileSystemWriter(tmp_path, overwrite=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.ones(4, 4)}, storage_writer=dcp.FileSystemWriter(tmp_path))
    loaded = {"a": torch.zeros(4, 4)}
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path))
    assert torch.equal(loaded["a"], torch.ones(4, 4))


def test_storage_meta_carries_save_and_load_ids(storage: str, tmp_path: Path) -> None:
    writer = dcp.FileSystemWriter(tmp_path)
    dcp.save(_sd(), storage_writer=writer)
    reader = dcp.FileSystemReader(tmp_path)
    meta = reader.read_metadata().storage_meta
    assert meta is not None
    assert str(meta.checkpoint_id) == str(tmp_path)
    assert meta.save_id == writer.save_id and meta.save_id
    assert meta.load_id == reader.load_id and meta.load_id
    reader.reset()
    assert reader.load_id != meta.load_id  # a new load, a new id


def test_the_load_planner_sees_the_metadata_version(storage: str, tmp_path: Path) -> None:
    dcp.save({"module": torch.nn.Linear(2, 2)}, checkpoint_id=tmp_path)
    planner = DefaultLoadPlanner()
    dcp.load({"module": torch.nn.Linear(2, 2)}, checkpoint_id=tmp_path, planner=planner)
    assert planner.metadata is not None
    assert planner.metadata.version == CURRENT_DCP_VERSION


def test_torch_save_to_dcp_into_a_directory_of_other_files(storage: str, tmp_path: Path
                                                          ) -> None:
    """FileSystemWriter writes its files beside model.pt; the plugin refuses a location
    holding files that are not a checkpoint's, even with overwrite=True, and touches
    nothing (docs/dcp.md says why); a directory of its own works."""
    torch.save(_sd(), tmp_path / "model.pt")
    before = (tmp_path / "model.pt").read_bytes()
    if storage == "filesystem":
        torch_save_to_dcp(tmp_path / "model.pt", tmp_path)
    else:
        with pytest.raises(dcp.api.CheckpointException, match=r"not a UCP checkpoint.*'model\.pt'"):
            torch_save_to_dcp(tmp_path / "model.pt", tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt"]
        torch_save_to_dcp(tmp_path / "model.pt", tmp_path / "dcp")
    assert (tmp_path / "model.pt").read_bytes() == before
    loaded = {"a": torch.zeros(4, 4)}
    dcp.load(loaded, checkpoint_id=tmp_path if storage == "filesystem" else tmp_path / "dcp")
    assert torch.equal(loaded["a"], _sd()["a"])
