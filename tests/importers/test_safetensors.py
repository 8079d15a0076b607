"""safetensors <-> UCP, against files written by the safetensors library and Hugging Face."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.importers.conftest import assert_same
from ucpformat import exporters, importers
from ucpformat.errors import FormatError, UnsupportedDtypeError

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.uint16, torch.uint32, torch.uint64, torch.complex64,
]


def _tensors() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for i, dt in enumerate(DTYPES):
        raw = torch.randint(0, 256, (5, 3 + i), dtype=torch.uint8, generator=g)
        width = torch.empty((), dtype=dt).element_size()
        raw = torch.randint(0, 256, (5, (3 + i) * width), dtype=torch.uint8, generator=g)
        if dt == torch.bool:
            raw = raw % 2  # a bool is 0x00 or 0x01 (UCP-1.0-R008, Table 1)
        out[f"layer.{i}.{str(dt).removeprefix('torch.')}"] = raw.view(dt)  # every bit pattern
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.zeros((0, 4), dtype=torch.bfloat16)
    bf = torch.tensor([1.0, -0.0, float("inf"), float("nan")], dtype=torch.bfloat16)
    out["bf16.special"] = bf
    return out


@pytest.fixture(scope="module")
def library_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    tensors = _tensors()
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_detect(library_file: tuple[Path, dict[str, Any]]) -> None:
    path, _ = library_file
    assert importers.detect(path) == "safetensors"
    assert importers.detect(path.parent) == "safetensors"


def test_every_dtype_bit_exact_and_file_identical(
    tmp_path: Path, library_file: tuple[Path, dict[str, Any]]
) -> None:
    path, tensors = library_file
    result = importers.convert(path, tmp_path / "ckpt", durable=False)
    assert result.tensors == len(tensors)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    for name, want in tensors.items():
        got = ckpt.tensor("model", name).read()
        assert_same(got, want, name)
    assert ckpt.tensor("model", "layer.10.float8_e4m3fn").meta.dtype.name == "float8_e4m3fn"
    assert ckpt.tensor("model", "layer.3.bfloat16").meta.dtype.name == "bfloat16"
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).valid
    # back: the library's own layout, byte for byte
    out = tmp_path / "back.safetensors"
    exporters.export(tmp_path / "ckpt", out, to="safetensors")
    assert out.read_bytes() == path.read_bytes()
    loaded = st.load_file(str(out))
    for name, want in tensors.items():
        assert_same(loaded[name], want, name)


def test_bool_bytes_other_than_0_and_1_are_refused(tmp_path: Path) -> None:
    """A BOOL tensor of the file holds a byte that is neither 0x00 nor 0x01: damage in UCP
    (UCP-1.0-R008), refused by name rather than stored or turned into true."""
    path = tmp_path / "model.safetensors"
    st.save_file({"mask": torch.tensor([0, 1, 2], dtype=torch.uint8).view(torch.bool)},
                 str(path))
    with pytest.raises(ucpformat.errors.InvalidValueError) as info:
        importers.convert(path, tmp_path / "ckpt", durable=False)
    assert info.value.rule == "UCP-1.0-R008" and info.value.tensor == "model/mask"
    assert not (tmp_path / "ckpt" / "zarr.json").exists()


def test_sharded_huggingface_directory(tmp_path: Path) -> None:
    hub = pytest.importorskip("huggingface_hub")
    tensors = {k: v for k, v in _tensors().items() if v.numel()}
    src = tmp_path / "hf"
    src.mkdir()
    hub.save_torch_state_dict(tensors, src, max_shard_size=200)
    assert (src / "model.safetensors.index.json").is_file()
    assert len(list(src.glob("*.safetensors"))) > 2
    importers.convert(src, tmp_path / "ckpt", durable=False)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    for name, want in tensors.items():
        assert_same(ckpt.tensor("model", name).read(), want, name)
    # export sharded again; the safetensors library reads every shard
    exporters.export(tmp_path / "ckpt", tmp_path / "out", to="safetensors", max_shard_size=200)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in
                                                  tensors.values())
    for name, want in tensors.items():
        got = st.load_file(str(tmp_path / "out" / index["weight_map"][name]))[name]
        assert_same(got, want, name)
    # and the exported directory imports to the same checkpoint
    importers.convert(tmp_path / "out", tmp_path / "again", durable=False)
    again = ucpformat.open(tmp_path / "again")
    assert again.keys() == ckpt.keys()


def _write_raw(
    path: Path, header: dict[str, Any], data: bytes, *, length: int | None = None
) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if length is None else length) + body + data)


@pytest.mark.parametrize(
    ("header", "data", "length", "error", "needle"),
    [
        ({"w": {"dtype": "F32", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 16]}},
         bytes(16), None, FormatError, "needs"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 50]}},
         bytes(16), None, FormatError, "outside"),
        ({"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}},
         bytes(2), None, UnsupportedDtypeError, "F4"),
        ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
         bytes(16), 1 << 40, FormatError, "impossible"),
        ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}},
         bytes(16), None, FormatError, "shape"),
    ],
)
def test_hostile_headers_are_refused_before_anything_is_written(
    tmp_path: Path, header: dict[str, Any], data: bytes, length: int | None,
    error: type[Exception], needle: str,
) -> None:
    src = tmp_path / "bad.safetensors"
    _write_raw(src, header, data, length=length)
    with pytest.raises(error, match=needle):
        importers.convert(src, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_layout_semantics_inferred_from_a_llama_config(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "llama")
    result = importers.convert(tmp_path / "llama", tmp_path / "ckpt", durable=False)
    assert any("llama" in n for n in result.notes)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    q = ckpt.tensor("model", "model.layers.1.self_attn.q_proj.weight")
    assert q.attributes["layout"] == {"tp": {"dim": 0}, "layer": 1}
    assert q.meta.dtype.name == "bfloat16"
    o = ckpt.tensor("model", "model.layers.0.self_attn.o_proj.weight")
    assert o.attributes["layout"] == {"tp": {"dim": 1}, "layer": 0}
    emb = ckpt.tensor("model", "model.embed_tokens.weight")
    assert emb.attributes["layout"] == {"tp": {"dim": 0}, "vocab": {"dim": 0}}
    assert ucpformat.validate(tmp_path / "ckpt", deep=True).valid
    for name, want in model.state_dict().items():
        assert_same(ckpt.tensor("model", name).read(), want, name)


def test_an_explicit_rule_file_that_does_not_fit_is_refused(
    tmp_path: Path, library_file: tuple[Path, dict[str, Any]]
) -> None:
    path, _ = library_file
    with pytest.raises(ucpformat.errors.LayoutError, match="no rule"):
        importers.convert(path, tmp_path / "ckpt", rules="llama", rule_params={"vocab_size": 8})


@pytest.mark.slow
def test_minilm_round_trip_bit_exact_and_same_outputs(tmp_path: Path, minilm_dir: Path) -> None:
    """A real published model: import, load from UCP, export, load with transformers."""
    transformers = pytest.importorskip("transformers")
    src = minilm_dir / "model.safetensors"
    importers.convert(minilm_dir, tmp_path / "ckpt", durable=False)
    ckpt = ucpformat.open(tmp_path / "ckpt")
    assert len(ckpt) == 104
    reference = st.load_file(str(src))
    for name, want in reference.items():
        assert_same(ckpt.tensor("model", name).read(), want, name)
    exporters.export(tmp_path / "ckpt", tmp_path / "out", to="safetensors")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == src.read_bytes()

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    batch = tok(["universal checkpoints", "zarr v3 shards, bit for bit"], padding=True,
                return_tensors="pt")
    original = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    with torch.no_grad():
        want = original(**batch).last_hidden_state
    # a fresh model given the UCP tensors
    fresh = transformers.AutoModel.from_config(original.config).eval()
    from ucpformat.interchange import from_numpy

    state = {t.name: from_numpy(t.read()) for t in ckpt.tensors("model")}
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert missing == []
    assert set(unexpected) <= {"embeddings.position_ids"}
    with torch.no_grad():
        got = fresh(**batch).last_hidden_state
    assert torch.equal(got, want)
    # the exported directory (weights + config.json) loads with transformers
    exported = transformers.AutoModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.equal(exported(**batch).last_hidden_state, want)
    assert np.isfinite(want.numpy()).all()


# -- __metadata__ through import and export (issue 29, item 3) --------------------------------


def _header(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc: dict[str, Any] = json.loads(raw[8 : 8 + n])
    return doc


@pytest.mark.parametrize("metadata", [
    None,
    {"format": "pt"},
    {"z": "1", "a": "2", "format": "pt", "m": "3", "b": "4"},  # any order the library picks
    {"name": "mine"},
])
def test_metadata_comes_back_byte_for_byte(tmp_path: Path,
                                           metadata: dict[str, str] | None) -> None:
    tensors = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "b": torch.ones(3, dtype=torch.bfloat16)}
    src = tmp_path / "model.safetensors"
    st.save_file(tensors, str(src), metadata=metadata)
    importers.convert(src, tmp_path / "ckpt", durable=False)
    for dest in (tmp_path / "one.safetensors", tmp_path / "dir"):
        exporters.export(tmp_path / "ckpt", dest, to="safetensors")
        out = dest if dest.suffix else dest / "model.safetensors"
        assert out.read_bytes() == src.read_bytes(), dest
        assert list((_header(out).get("__metadata__") or {}).items()) == list(
            (_header(src).get("__metadata__") or {}).items())


def test_shards_keep_their_metadata(tmp_path: Path) -> None:
    """Hugging Face's shards (``{"format": "pt"}`` each, the user's metadata in the index)
    export back byte for byte, the index's metadata kept."""
    hub = pytest.importorskip("huggingface_hub")
    tensors = {f"layer.{i}": torch.full((8,), float(i)) for i in range(4)}
    src = tmp_path / "hf"
    src.mkdir()
    hub.save_torch_state_dict(tensors, src, max_shard_size=64, metadata={"run": "r1"})
    importers.convert(src, tmp_path / "ckpt", durable=False)
    exporters.export(tmp_path / "ckpt", tmp_path / "out", to="safetensors", max_shard_size=64)
    shards = sorted(src.glob("*.safetensors"))
    assert len(shards) > 1
    for f in shards:
        assert (tmp_path / "out" / f.name).read_bytes() == f.read_bytes(), f.name
    index = "model.safetensors.index.json"
    assert json.loads((tmp_path / "out" / index).read_text()) == json.loads(
        (src / index).read_text())


def test_differing_file_metadata_is_a_note(tmp_path: Path) -> None:
    src = tmp_path / "two"
    src.mkdir()
    st.save_file({"a": torch.ones(2)}, str(src / "a.safetensors"), metadata={"part": "a"})
    st.save_file({"b": torch.ones(2)}, str(src / "b.safetensors"), metadata={"part": "b"})
    importers.convert(src, tmp_path / "ckpt", durable=False)
    result = exporters.export(tmp_path / "ckpt", tmp_path / "one.safetensors", to="safetensors")
    assert _header(tmp_path / "one.safetensors")["__metadata__"] == {"format": "pt"}
    assert any("__metadata__ differ" in n for n in result.notes), result.notes
    exporters.export(tmp_path / "ckpt", tmp_path / "mine.safetensors", to="safetensors",
                     metadata={"k": "v"})
    assert _header(tmp_path / "mine.safetensors")["__metadata__"] == {"k": "v"}


# -- a Hugging Face Trainer checkpoint directory (issue 29, item 2) ----------------------------


@pytest.fixture
def trainer_dir(tmp_path: Path) -> Path:
    """What transformers' Trainer leaves in checkpoint-<step>/ (the files, not a run)."""
    d = tmp_path / "checkpoint-10"
    d.mkdir()
    st.save_file({"w": torch.ones(2, 2), "b": torch.zeros(2)}, str(d / "model.safetensors"),
                 metadata={"format": "pt"})
    torch.save({"state": {0: {"step": torch.tensor(1.0)}}, "param_groups": []},
               d / "optimizer.pt")
    torch.save({"last_epoch": 1}, d / "scheduler.pt")
    torch.save({"cpu": torch.get_rng_state()}, d / "rng_state.pth")
    (d / "trainer_state.json").write_text('{"global_step": 10}')
    (d / "config.json").write_text('{"model_type": "gpt2"}')
    return d


def test_trainer_checkpoint_is_refused_naming_what_would_be_left(tmp_path: Path,
                                                                  trainer_dir: Path) -> None:
    with pytest.raises(FormatError) as info:
        importers.convert(trainer_dir, tmp_path / "ckpt", durable=False, format="safetensors")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert name in str(info.value)
    assert "weights_only=True" in str(info.value) and "'hf-trainer'" in str(info.value)
    assert not (tmp_path / "ckpt").exists()
    # detected as a Trainer checkpoint, whose pickles are read only when allowed
    assert importers.detect(trainer_dir) == "hf-trainer"
    with pytest.raises(FormatError, match=r"optimizer\.pt, scheduler\.pt, rng_state\.pth are "
                       r"pickles .*allow_pickle=True \(ucp convert --allow-pickle\)"):
        importers.convert(trainer_dir, tmp_path / "ckpt", durable=False)
    assert not (tmp_path / "ckpt").exists()


def test_trainer_checkpoint_weights_only_notes_what_was_left(tmp_path: Path,
                                                             trainer_dir: Path) -> None:
    result = importers.convert(trainer_dir, tmp_path / "ckpt", durable=False, weights_only=True)
    assert result.tensors == 2
    (note,) = [n for n in result.notes if "training state was not converted" in n]
    assert "optimizer.pt, rng_state.pth, scheduler.pt, trainer_state.json" in note


def test_ucp_convert_of_a_trainer_checkpoint(tmp_path: Path, trainer_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from ucpformat.cli import main

    assert main(["convert", str(trainer_dir), str(tmp_path / "ckpt")]) == 2
    out, err = capsys.readouterr()
    assert "optimizer.pt" in out + err and "--weights-only" in out + err
    assert main(["convert", "--weights-only", str(trainer_dir), str(tmp_path / "ckpt")]) == 0
    out, _ = capsys.readouterr()
    assert "note: weights only: the training state was not converted" in out
