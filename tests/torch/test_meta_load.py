"""Loading into a model built on the meta device: refused without ``assign`` (copying into
a meta tensor loads nothing), materialised from the checkpoint with ``assign=True``.

Distributed (FSDP2 and TP on meta, ``to_empty``) is in test_distributed.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.errors import LoadError  # noqa: E402
from ucpformat.torch import MetaTensorWarning  # noqa: E402

# the non-persistent buffer of the test model stays on meta: asserted where it matters
pytestmark = [pytest.mark.torch,
              pytest.mark.filterwarnings("ignore::ucpformat.torch.MetaTensorWarning")]

LOADERS = ["load", "load_distributed"]


class Tied(torch.nn.Module):
    """An embedding tied to the output head, a frozen layer, persistent and
    non-persistent buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(13, 6)
        self.body = torch.nn.Linear(6, 6)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 13, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("positions", torch.arange(4), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)
        x = self.norm(torch.relu(self.body(x)) + self.frozen(x))
        return self.head(x * self.scale)


def _raw(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _trained() -> Any:
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    for _ in range(2):
        model(torch.randint(0, 13, (8, 3))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def _on_meta() -> Any:
    with torch.device("meta"):
        return Tied()


def _load(loader: str, path: Path, model: Any, **kw: Any) -> Any:
    fn = ucpt.load if loader == "load" else ucpt.load_distributed
    return fn(path, model=model, **kw)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, Any]:
    model = _trained()
    ucpt.save(tmp_path / "c", model=model, durable=False)
    return tmp_path / "c", model


@pytest.mark.parametrize("loader", LOADERS)
def test_a_meta_model_is_refused_without_assign(saved: tuple[Path, Any], loader: str) -> None:
    path, _ = saved
    model = _on_meta()
    with pytest.raises(LoadError, match=r"'scale' and 11 more tensors on the meta device.*"
                       r"pass assign=True") as info:
        _load(loader, path, model)
    assert info.value.tensor == "model/scale"
    assert all(t.is_meta for t in model.state_dict().values())


@pytest.mark.parametrize("loader", LOADERS)
def test_one_meta_tensor_among_real_ones_is_refused_by_name(
    saved: tuple[Path, Any], loader: str
) -> None:
    path, _ = saved
    torch.manual_seed(3)
    model = Tied()
    with torch.device("meta"):
        model.body = torch.nn.Linear(6, 6)
    before = {k: _raw(v) for k, v in model.state_dict().items() if not v.is_meta}
    with pytest.raises(LoadError,
                       match=r"'body\.weight' and 1 more tensor on the meta device") as info:
        _load(loader, path, model)
    assert info.value.tensor == "model/body.weight"
    assert {k: _raw(v) for k, v in model.state_dict().items() if not v.is_meta} == before


@pytest.mark.parametrize("loader", LOADERS)
def test_assign_materialises_every_tensor_bit_for_bit_with_ties_kept(
    saved: tuple[Path, Any], loader: str
) -> None:
    path, src = saved
    model = _on_meta()
    with pytest.warns(MetaTensorWarning, match="'positions'"):
        result = _load(loader, path, model, assign=True)
    # the non-persistent buffer is in no checkpoint: it stays on meta, and says so
    assert result.on_meta == ["positions"]
    want = src.state_dict()
    got = model.state_dict()
    assert list(got) == list(want)
    for name, value in want.items():
        assert got[name].device.type == "cpu" and got[name].dtype == value.dtype, name
        assert _raw(got[name]) == _raw(value), name
    # tied: one Parameter object under both names, as tie_weights() makes it
    assert model.head.weight is model.emb.weight
    assert isinstance(model.emb.weight, torch.nn.Parameter)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in src.named_parameters()]
    # requires_grad is the model's own; buffers stay buffers
    assert not model.frozen.weight.requires_grad and model.body.weight.requires_grad
    assert dict(model.named_buffers()).keys() == dict(src.named_buffers()).keys()
    # an optimizer built afterwards trains the model (and the tie holds through a step)
    model.positions = torch.arange(4)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    before = model.emb.weight.detach().clone()
    model(torch.randint(0, 13, (8, 3))).square().mean().backward()
    opt.step()
    assert not torch.equal(model.emb.weight, before)
    assert model.head.weight is model.emb.weight
    assert not model.state_dict()["frozen.weight"].requires_grad


def test_assign_keeps_the_stored_dtype_and_lands_on_map_location(
    saved: tuple[Path, Any],
) -> None:
    """As torch's load_state_dict(assign=True): the checkpoint's tensor properties."""
    path, src = saved
    with torch.device("meta"):
        model = Tied().to(torch.bfloat16)
    ucpt.load(path, model=model, assign=True, map_location=torch.device("cpu"))
    assert model.body.weight.dtype == torch.float32
    assert _raw(model.body.weight) == _raw(src.body.weight)


def test_assign_with_torch_swap_keeps_the_parameter_objects(
    saved: tuple[Path, Any],
) -> None:
    """With torch's swap_module_params_on_conversion, torch swaps the data into the live
    objects: references held elsewhere stay valid, and a tied tensor is given once."""
    path, src = saved
    model = _on_meta()
    emb = model.emb.weight
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        ucpt.load(path, model=model, assign=True)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert model.emb.weight is emb and model.head.weight is emb
    assert _raw(emb) == _raw(src.emb.weight)


def test_assign_on_a_model_with_memory_replaces_its_tensors(saved: tuple[Path, Any]) -> None:
    path, src = saved
    torch.manual_seed(5)
    model = Tied()
    old = model.body.weight
    ucpt.load(path, model=model, assign=True)
    assert model.body.weight is not old and _raw(model.body.weight) == _raw(src.body.weight)
    assert _raw(old) != _raw(src.body.weight)  # copied into, it would have changed


@pytest.mark.parametrize("loader", LOADERS)
def test_assign_with_an_optimizer_is_refused_before_anything_changes(
    tmp_path: Path, loader: str
) -> None:
    src = _trained()
    opt = torch.optim.AdamW(src.parameters(), lr=0.01)
    ucpt.save(tmp_path / "c", model=src, optimizer=opt, durable=False)
    model = _on_meta()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(LoadError, match="assign=True replaces the model's parameters"):
        _load(loader, tmp_path / "c", model, optimizer=opt, assign=True)
    assert all(t.is_meta for t in model.state_dict().values())
    # the two steps that work: the model by assignment, then an optimizer built on it
    ucpt.load(tmp_path / "c", model=model, assign=True, strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    ucpt.load(tmp_path / "c", model=model, optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.01
    assert all(not v["exp_avg"].is_meta for v in opt.state.values())


def test_an_optimizer_on_meta_parameters_is_refused(saved: tuple[Path, Any]) -> None:
    src = _trained()
    opt = torch.optim.AdamW(src.named_parameters(), lr=0.01)
    src(torch.randint(0, 13, (8, 3))).sum().backward()
    opt.step()
    path = saved[0].parent / "opt"
    ucpt.save(path, optimizer=opt, durable=False)
    model = _on_meta()
    meta_opt = torch.optim.AdamW(model.named_parameters(), lr=0.5)
    with pytest.raises(LoadError, match=r"'emb\.weight' is on the meta device"):
        ucpt.load(path, optimizer=meta_opt)
    assert meta_opt.state == {} and meta_opt.param_groups[0]["lr"] == 0.5


def test_map_location_meta_is_refused(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    with pytest.raises(LoadError, match="meta device"):
        ucpt.load_state_dict(path, map_location="meta")
    with pytest.raises(LoadError, match="meta device"):
        ucpt.load(path, model=_on_meta(), assign=True, map_location="meta")


@pytest.mark.slow
def test_a_hugging_face_model_built_on_meta_loads_from_ucp(
    tmp_path: Path, minilm_dir: Path
) -> None:
    """all-MiniLM-L6-v2 built on meta, its weights converted from safetensors to UCP:
    every weight bit for bit, the same outputs as transformers' own from_pretrained."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = pytest.importorskip("transformers")
    st = pytest.importorskip("safetensors.torch")
    from ucpformat import importers

    importers.convert(minilm_dir, tmp_path / "ckpt", durable=False)
    config = transformers.AutoConfig.from_pretrained(minilm_dir)
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    with pytest.warns(MetaTensorWarning):
        result = ucpt.load(tmp_path / "ckpt", model=model, assign=True, strict=False)
    # the safetensors file carries the old position_ids buffer, non-persistent today
    assert result.missing_keys == []
    assert set(result.unexpected_keys) <= {"embeddings.position_ids"}
    assert set(result.on_meta) == {"embeddings.position_ids", "embeddings.token_type_ids"}
    reference = st.load_file(str(minilm_dir / "model.safetensors"))
    for name, value in model.state_dict().items():
        assert _raw(value) == _raw(reference[name]), name
    # non-persistent buffers are made as the model's own initialisation makes them
    emb = model.embeddings
    emb.position_ids = torch.arange(config.max_position_embeddings).expand((1, -1))
    emb.token_type_ids = torch.zeros_like(emb.position_ids)
    model.eval()
    original = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    batch = tok(["universal checkpoints", "built on meta, loaded by assignment"],
                padding=True, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(model(**batch).last_hidden_state,
                           original(**batch).last_hidden_state)
