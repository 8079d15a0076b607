"""The flat tensor API (save_file / load_file / safe_open), against safetensors' behaviour."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.errors import (  # noqa: E402
    CheckpointExistsError,
    InvalidValueError,
    LoadError,
    TensorNotFoundError,
    UCPError,
)
from ucpformat.store import LocalStore  # noqa: E402

pytestmark = pytest.mark.torch


def raw(t: Any) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    out = {
        "embed.weight": torch.randn(50, 16, generator=g),
        "layers.0.attn.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layers.0.scale": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
        "steps": torch.tensor(7, dtype=torch.int64),
        "mask": torch.rand(4, 4, generator=g) > 0.5,
        "phase": torch.randn(3, dtype=torch.complex64, generator=g),
        "empty": torch.zeros(0, 5),
        "odd/name with spaces": torch.arange(6, dtype=torch.int32),
    }
    out["nan_and_zero"] = torch.tensor([float("nan"), -0.0, float("-inf")])
    return out


def test_round_trip_bit_exact_with_metadata(tmp_path: Path) -> None:
    src = tensors()
    meta = {"format": "pt", "run": {"lr": 3e-4, "tags": ["a", "b"]}}
    ucpt.save_file(src, tmp_path / "c", metadata=meta)
    back = ucpt.load_file(tmp_path / "c")
    assert sorted(back) == sorted(src)
    for name, t in src.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert raw(back[name]) == raw(t), name
    with ucpt.safe_open(tmp_path / "c", framework="pt") as f:
        assert f.metadata() == meta
        assert f.keys() == sorted(src)  # sorted, as safetensors lists them
    assert ucpformat.validate(tmp_path / "c", deep=True).valid


def test_tied_tensors_stored_once_and_loaded_as_one(tmp_path: Path) -> None:
    w = torch.randn(8, 4)
    ucpt.save_file({"embed.weight": w, "lm_head.weight": w, "t": w.t()}, tmp_path / "c")
    with ucpformat.open(tmp_path / "c") as ckpt:
        assert sorted(ckpt.arrays) == ["model/embed.weight", "model/t"]  # the view: a copy
        assert ckpt.groups["model"].ucp["aliases"] == {"lm_head.weight": "embed.weight"}
    back = ucpt.load_file(tmp_path / "c")
    assert back["lm_head.weight"] is back["embed.weight"]
    assert torch.equal(back["t"], w.t())  # a non-contiguous tensor is stored (a copy)


def test_refusals_name_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match="int, not a tensor") as info:
        ucpt.save_file({"w": torch.ones(2), "n": 3}, tmp_path / "a")  # type: ignore[dict-item]
    assert info.value.tensor == "model/n"
    with pytest.raises(InvalidValueError, match="mapping of names to tensors"):
        ucpt.save_file([torch.ones(2)], tmp_path / "a")  # type: ignore[arg-type]
    assert not (tmp_path / "a").exists()
    ucpt.save_file({"w": torch.ones(2)}, tmp_path / "a")
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        ucpt.save_file({"w": torch.zeros(2)}, tmp_path / "a")
    ucpt.save_file({"w": torch.zeros(2)}, tmp_path / "a", overwrite=True)
    assert torch.equal(ucpt.load_file(tmp_path / "a")["w"], torch.zeros(2))


class CountingStore(LocalStore):
    """Records every key read."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, durable=False)
        self.keys: Counter[str] = Counter()

    def get(self, key: str) -> bytes | None:
        self.keys[key] += 1
        return super().get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        self.keys[key] += 1
        return super().get_range(key, offset, length)

    def get_suffix(self, key: str, length: int) -> bytes | None:
        self.keys[key] += 1
        return super().get_suffix(key, length)

    def read_into(self, key: str, offset: int, buffers: Any) -> int | None:
        self.keys[key] += 1
        return super().read_into(key, offset, buffers)


def test_open_and_list_read_the_root_metadata_only(tmp_path: Path) -> None:
    ucpt.save_file(tensors(), tmp_path / "c", metadata={"a": "b"})
    store = CountingStore(tmp_path / "c")
    with ucpt.safe_open(store, framework="pt", device="cpu") as f:
        names = f.keys()
        shapes = {n: f.get_slice(n).get_shape() for n in names}
        dtypes = {n: f.get_slice(n).get_dtype() for n in names}
        assert f.metadata() == {"a": "b"}
        assert f.checkpoint.stats.bytes_read == 0
    assert set(store.keys) == {"zarr.json"} and store.keys["zarr.json"] == 1
    assert shapes["embed.weight"] == [50, 16] and shapes["steps"] == []
    assert dtypes["layers.0.attn.weight"] == "bfloat16"
    assert dtypes["layers.0.scale"] == "float8_e4m3fn"


def test_get_slice_reads_only_the_chunks_it_needs(tmp_path: Path) -> None:
    w = torch.randn(256, 64)
    ucpt.save_file({"w": w}, tmp_path / "c", chunk_bytes=4096)  # chunks of 16 rows
    with ucpt.safe_open(tmp_path / "c", framework="pt") as f:
        part = f.get_slice("w")[32:48]
        assert torch.equal(part, w[32:48])
        assert f.checkpoint.stats.bytes_read < w.numel() * 4 // 8
        for index in [(slice(None), slice(0, 64, 8)), (5,), (-1, slice(3, None)),
                      (Ellipsis, 7), (slice(200, 10, -30),), (slice(None, None, 3), 2)]:
            got = f.get_slice("w")[index]
            want = torch.from_numpy(w.numpy()[index].copy())
            assert got.shape == want.shape and torch.equal(got, want), index


def test_same_answers_as_safetensors(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    from safetensors import safe_open as st_open

    src = {k: v for k, v in tensors().items() if k != "phase"}  # safetensors has no complex
    st.save_file(src, str(tmp_path / "m.safetensors"), metadata={"k": "v"})
    ucpt.save_file(src, tmp_path / "c", metadata={"k": "v"})
    theirs, ours = st.load_file(str(tmp_path / "m.safetensors")), ucpt.load_file(tmp_path / "c")
    assert sorted(theirs) == sorted(ours)
    for name in theirs:
        assert raw(theirs[name]) == raw(ours[name]) and theirs[name].dtype == ours[name].dtype
    with st_open(str(tmp_path / "m.safetensors"), framework="pt") as a, \
            ucpt.safe_open(tmp_path / "c", framework="pt") as b:
        assert a.keys() == b.keys() and a.metadata() == b.metadata()
        for name in a.keys():  # noqa: SIM118 - safe_open objects are not mappings
            assert a.get_slice(name).get_shape() == b.get_slice(name).get_shape()
            if a.get_slice(name).get_shape()[:1] not in ([], [0]):
                assert raw(a.get_slice(name)[1:3]) == raw(b.get_slice(name)[1:3]), name
            assert raw(a.get_tensor(name)) == raw(b.get_tensor(name)), name


def test_safe_open_errors_and_numpy(tmp_path: Path) -> None:
    ucpt.save_file({"w": torch.arange(6.0)}, tmp_path / "c")
    f = ucpt.safe_open(tmp_path / "c", framework="numpy")
    assert isinstance(f.get_tensor("w"), np.ndarray)
    assert isinstance(f.get_slice("w")[2:4], np.ndarray)
    with pytest.raises(TensorNotFoundError, match="no tensor 'v'"):
        f.get_tensor("v")
    f.close()
    with pytest.raises(UCPError, match="closed"):
        f.keys()
    with pytest.raises(LoadError, match="framework"):
        ucpt.safe_open(tmp_path / "c", framework="tf")
    with pytest.raises(LoadError, match="numpy arrays live on the CPU"):
        ucpt.safe_open(tmp_path / "c", framework="numpy", device="meta")
    with pytest.raises(TensorNotFoundError, match="no group 'optimizer'"):
        ucpt.safe_open(tmp_path / "c", prefix="optimizer")


def test_load_file_on_a_device(tmp_path: Path) -> None:
    ucpt.save_file({"w": torch.arange(6.0)}, tmp_path / "c")
    with pytest.raises(LoadError, match="meta device"):  # tensors there would hold nothing
        ucpt.load_file(tmp_path / "c", device="meta")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device for the integer device index")
    assert ucpt.load_file(tmp_path / "c", device=0)["w"].device == torch.device("cuda", 0)


# -- ucpformat.torch.save with a state dict --------------------------------------------------------


def test_save_takes_a_state_dict_as_model(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    ucpt.save(tmp_path / "sd", model=model.state_dict(), step=1)
    other = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    assert ucpt.load(tmp_path / "sd", model=other).step == 1
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
    with ucpformat.open(tmp_path / "sd") as ckpt:  # parameter or buffer: not known
        assert all("role" not in t.attributes for t in ckpt.tensors("model"))
    # the optimizer's parameters are named from the mapping's parameter objects
    ucpt.save(tmp_path / "named", model=dict(model.named_parameters()), optimizer=opt)
    assert ucpt.read_optimizer_state(tmp_path / "named")["param_groups"][0]["params"] == [
        "0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(InvalidValueError, match=r"pass an nn\.Module, or a mapping"):
        ucpt.save(tmp_path / "bad", model=[torch.ones(1)])  # type: ignore[arg-type]
    with pytest.raises(LoadError, match="use load_file"):
        ucpt.load(tmp_path / "sd", model={"0.weight": torch.ones(3, 4)})  # type: ignore[arg-type]
