"""ucpformat.torch: bit-exact conversion, and single-process save/load of training state."""

from __future__ import annotations

import collections
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.errors import (  # noqa: E402
    InvalidValueError,
    KeyMismatchError,
    LoadError,
    ShapeMismatchError,
    UnsupportedDtypeError,
)
from ucpformat.format import dtypes  # noqa: E402

pytestmark = pytest.mark.torch

TORCH_TYPES = [d for d in dtypes.DATA_TYPES if d.name in ucpt.numpy_bridge.TORCH_OF_DATA_TYPE]


# -- helpers -----------------------------------------------------------------------------


def raw(t: Any) -> bytes:
    """The bytes of a tensor (CPU, contiguous): equal bytes = bit-identical."""
    if t.numel() == 0:
        return b""
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Bit-identical tensors, equal values, same container types, recursively."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        assert raw(a) == raw(b), f"{where}: bits differ"
    elif isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and a != a:
        assert b != b, where
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def mlp(seed: int = 0, dropout: float = 0.0) -> Any:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.LayerNorm(16),
        torch.nn.ReLU(),
        torch.nn.Dropout(dropout),
        torch.nn.Linear(16, 3),
    )


def batch(i: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def train(model: Any, opt: Any, sched: Any, steps: range, plateau: bool = False) -> list[float]:
    losses = []
    for i in steps:
        x, y = batch(i)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step(loss.item()) if plateau else sched.step()
        losses.append(loss.item())
    return losses


# -- convert -----------------------------------------------------------------------------


def test_every_closed_list_type_that_torch_has_converts() -> None:
    names = {d.name for d in TORCH_TYPES}
    for d in dtypes.DATA_TYPES:
        if d.torch_name and isinstance(getattr(torch, d.torch_name, None), torch.dtype):
            assert d.name in names
    assert {"bool", "uint64", "bfloat16", "float8_e4m3fn", "complex128"} <= names


@pytest.mark.parametrize("dt", TORCH_TYPES, ids=lambda d: d.name)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_convert_round_trips_any_bits(dt: dtypes.DataType, data: st.DataObject) -> None:
    shape = data.draw(st.lists(st.integers(0, 4), min_size=0, max_size=3), label="shape")
    n = int(np.prod(shape, dtype=np.int64))
    if dt.name == "bool":  # only 0 and 1 are bools
        blob = bytes(data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    else:
        blob = data.draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))
    arr = np.frombuffer(blob, dtype=dt.numpy).reshape(shape).copy()
    t = ucpt.from_numpy(arr, name="x")
    assert t.dtype == ucpt.torch_dtype(dt) and tuple(t.shape) == tuple(shape)
    assert raw(t) == blob
    back = ucpt.to_numpy(t, name="x")
    assert back.dtype == dt.numpy and back.shape == tuple(shape)
    assert back.tobytes() == blob


@pytest.mark.parametrize("dt", [d for d in TORCH_TYPES if d.itemsize <= 2 and d.kind == "float"],
                         ids=lambda d: d.name)
def test_convert_every_bit_pattern_of_narrow_floats(dt: dtypes.DataType) -> None:
    carrier = np.uint8 if dt.itemsize == 1 else np.uint16
    patterns = np.arange(2 ** (8 * dt.itemsize), dtype=carrier)
    t = ucpt.from_numpy(patterns.view(dt.numpy), name="all")
    assert raw(t) == patterns.tobytes()
    assert ucpt.to_numpy(t).tobytes() == patterns.tobytes()
    # torch reads the same values as ml_dtypes (the types really are the same)
    finite = np.isfinite(patterns.view(dt.numpy).astype(np.float32))
    np.testing.assert_array_equal(
        t.float().numpy()[finite], patterns.view(dt.numpy).astype(np.float32)[finite]
    )


def test_convert_keeps_nan_payloads_and_negative_zero() -> None:
    bits32 = np.array([0x7FC00001, 0xFFBADBAD, 0x7F800001, 0x80000000], np.uint32)
    t = ucpt.from_numpy(bits32.view(np.float32))
    assert t.view(torch.int32).numpy().view(np.uint32).tolist() == bits32.tolist()
    assert ucpt.to_numpy(t).view(np.uint32).tolist() == bits32.tolist()
    bf = torch.tensor([0x7FC1, -0x7F3F, -0x8000], dtype=torch.int16).view(torch.bfloat16)
    assert ucpt.to_numpy(bf).view(np.int16).tolist() == [0x7FC1, -0x7F3F, -0x8000]


def test_convert_shares_memory_when_it_can() -> None:
    t = torch.zeros(4, 5)
    a = ucpt.to_numpy(t)
    a[0, 0] = 7.0
    assert t[0, 0] == 7.0
    b = torch.zeros(3, dtype=torch.bfloat16)
    ucpt.to_numpy(b)[1] = 2.0
    assert b[1] == 2.0
    arr = np.zeros(3, np.float32)
    ucpt.from_numpy(arr)[2] = 5.0
    assert arr[2] == 5.0


def test_convert_makes_views_contiguous_and_resolves_conj_and_neg() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for view in (base.t(), base[:, ::2], base[1:3, 1:5], torch.tensor(3.0).expand(2, 3)):
        assert ucpt.to_numpy(view).tolist() == view.tolist()
    c = torch.complex(torch.randn(3), torch.randn(3)).conj()
    assert c.is_conj()
    np.testing.assert_array_equal(ucpt.to_numpy(c), c.resolve_conj().numpy())
    p = torch.nn.Parameter(torch.ones(2))
    assert ucpt.to_numpy(p).tolist() == [1.0, 1.0]
    # 0-d and empty tensors of an ml_dtypes type
    s = torch.tensor(1.5, dtype=torch.bfloat16)
    assert ucpt.to_numpy(s).shape == () and float(ucpt.to_numpy(s)) == 1.5
    assert ucpt.from_numpy(ucpt.to_numpy(s)).shape == ()
    assert ucpt.to_numpy(torch.empty(0, 3, dtype=torch.float8_e5m2)).shape == (0, 3)


def test_from_numpy_copies_read_only_and_byte_swapped_arrays() -> None:
    ro = np.arange(4, dtype=np.float32)
    ro.flags.writeable = False
    assert ucpt.from_numpy(ro).tolist() == [0, 1, 2, 3]
    be = np.arange(3, dtype=">i4")
    t = ucpt.from_numpy(be)
    assert t.dtype == torch.int32 and t.tolist() == [0, 1, 2]
    assert ucpt.from_numpy(np.arange(6, dtype=np.int64).reshape(2, 3).T).tolist() == [
        [0, 3], [1, 4], [2, 5]
    ]


@pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")
def test_unsupported_dtypes_raise_naming_the_tensor() -> None:
    f4 = torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    with pytest.raises(UnsupportedDtypeError, match=r"model/head\.w4.*float4_e2m1fn_x2"):
        ucpt.to_numpy(f4, name="model/head.w4")
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(UnsupportedDtypeError, match="qtensor"):
        ucpt.to_numpy(q, name="qtensor")
    with pytest.raises(InvalidValueError, match=r"sp.*layout"):
        ucpt.to_numpy(torch.eye(2).to_sparse(), name="sp")
    with pytest.raises(UnsupportedDtypeError, match="arr"):
        ucpt.from_numpy(np.zeros(2, np.float128 if hasattr(np, "float128") else "U1"), name="arr")


def test_save_refuses_an_unsupported_buffer_naming_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    model.register_buffer("packed", torch.zeros(2, dtype=torch.uint8).view(torch.float4_e2m1fn_x2))
    with pytest.raises(UnsupportedDtypeError, match=r"model/packed"):
        ucpt.save(tmp_path / "c", model=model)
    assert not (tmp_path / "c" / "zarr.json").exists()


# -- save / load: round trips --------------------------------------------------------------

OPTIMIZERS: dict[str, Callable[[Any], Any]] = {
    "adam-amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "rmsprop-centered": lambda p: torch.optim.RMSprop(p, lr=1e-2, momentum=0.5, centered=True),
    "nadam": lambda p: torch.optim.NAdam(p, lr=1e-2),
    "rprop": lambda p: torch.optim.Rprop(p, lr=1e-2),
    "asgd": lambda p: torch.optim.ASGD(p, lr=1e-2),
    "adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-2),
    "adam-tensor-lr": lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), foreach=False),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_round_trip_is_bit_exact_for_each_optimizer(tmp_path: Path, name: str) -> None:
    model = mlp(0)
    opt = OPTIMIZERS[name](model.parameters())
    train(model, opt, None, range(3))
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, step=3)
    assert ucpformat.validate(tmp_path / "c").valid

    model2 = mlp(1)
    opt2 = OPTIMIZERS[name](model2.parameters())
    result = ucpt.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert result.step == 3 and result.missing_keys == [] == result.unexpected_keys
    assert_same(model.state_dict(), model2.state_dict(), "model")
    assert_same(opt.state_dict(), opt2.state_dict(), "optimizer")
    # the stored per-parameter state holds every state name torch has
    ckpt = ucpformat.open(tmp_path / "c")
    params = dict(model.named_parameters())
    stored = ucpt.read_optimizer_state(ckpt)["state"]
    assert set(stored) == set(params)
    for fqn, entry in stored.items():
        assert set(entry) == set(opt.state[params[fqn]])
    roles = {t.path: t.attributes["role"] for t in ckpt.tensors()}
    assert roles["model/0.weight"] == "parameter"
    assert all(r == "optimizer_state" for p, r in roles.items() if p.startswith("optimizer/"))


class Mixed(torch.nn.Module):
    """bf16 and fp8 parameters and buffers, a tied weight, a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8, dtype=torch.bfloat16)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 11, bias=False, dtype=torch.bfloat16)
        self.head.weight = self.emb.weight  # tied
        self.scale8 = torch.nn.Parameter(torch.randn(4).to(torch.float8_e4m3fn),
                                         requires_grad=False)
        self.register_buffer("amax", torch.randn(5).to(torch.float8_e5m2))
        self.register_buffer("f8fnuz", torch.randn(3).to(torch.float8_e4m3fnuz))
        self.register_buffer("counts", torch.tensor([0, 1, 2**64 - 1], dtype=torch.uint64))
        self.register_buffer("odd", torch.tensor([-0.0, float("nan"), 1.0]))
        self.odd.view(torch.int32)[1] = 0x7FC0BEEF  # a NaN with a payload

    def forward(self, ids: Any) -> Any:
        h = self.emb(ids).float()
        h = torch.relu(self.body(h)).to(torch.bfloat16)
        return self.head(h)


def test_round_trip_mixed_dtypes_and_tied_weight(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for _ in range(2):
        opt.zero_grad()
        model(ids).float().square().mean().backward()
        opt.step()
    ucpt.save(tmp_path / "c", model=model, optimizer=opt)
    assert ucpformat.validate(tmp_path / "c", deep=True).valid
    ckpt = ucpformat.open(tmp_path / "c")
    # the tied weight is stored once, under its first name; the other is an alias (R108)
    assert "model/emb.weight" in ckpt and "model/head.weight" not in ckpt
    assert ckpt.groups["model"].ucp["aliases"] == {"head.weight": "emb.weight"}
    groups = ckpt.values("optimizer")["param_groups"]
    assert "emb.weight" in groups[0]["params"] and "head.weight" not in groups[0]["params"]
    assert ckpt["model/scale8"].meta.dtype.name == "float8_e4m3fn"
    assert ckpt["model/amax"].attributes["role"] == "buffer"
    assert ckpt["model/scale8"].attributes["role"] == "parameter"

    torch.manual_seed(1)
    model2 = Mixed()
    opt2 = torch.optim.AdamW([p for p in model2.parameters() if p.requires_grad], lr=1e-2)
    ucpt.load(ckpt, model=model2, optimizer=opt2)
    assert_same(model.state_dict(), model2.state_dict(), "model")
    assert_same(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert model2.head.weight is model2.emb.weight
    assert model2.odd.view(torch.int32)[1].item() == 0x7FC0BEEF


def test_tied_weight_loads_into_an_untied_model_and_into_a_state_dict(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Mixed()
    ucpt.save(tmp_path / "c", model=model)
    untied = Mixed()
    untied.head.weight = torch.nn.Parameter(torch.zeros(11, 8, dtype=torch.bfloat16))
    ckpt = ucpformat.open(tmp_path / "c")
    ucpt.load(ckpt, model=untied)
    assert raw(untied.head.weight) == raw(model.emb.weight) == raw(untied.emb.weight)
    sd = ucpt.load_state_dict(ckpt)
    assert sd["head.weight"] is sd["emb.weight"]
    fresh = Mixed()
    fresh.load_state_dict(sd)
    assert_same(dict(model.state_dict()), dict(fresh.state_dict()))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_wrapper_prefixes_are_not_part_of_names(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, None, range(1))
    compiled = torch.compile(model)  # compiles lazily: nothing is compiled here
    assert next(iter(compiled.state_dict())).startswith("_orig_mod.")
    ucpt.save(tmp_path / "c", model=compiled, optimizer=opt)
    assert "model/0.weight" in ucpformat.open(tmp_path / "c")
    wrapped = torch.nn.DataParallel(mlp(1))
    opt2 = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ucpt.load(tmp_path / "c", model=wrapped, optimizer=opt2)
    assert_same(dict(model.state_dict()), dict(wrapped.module.state_dict()))
    assert_same(opt.state_dict(), opt2.state_dict())


SCHEDULERS: dict[str, Callable[[Any], Any]] = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20),
    "plateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0),
    "multistep": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 4, 4]),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_round_trip_and_resume(tmp_path: Path, name: str) -> None:
    plateau = name == "plateau"
    model = mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = SCHEDULERS[name](opt)
    train(model, opt, sched, range(3), plateau)
    if plateau:
        assert sched.best != float("inf")
        fresh = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        assert fresh.best == float("inf")  # stored as the tagged non-finite float
        ucpt.save(tmp_path / "inf", scheduler=fresh)
        assert ucpformat.open(tmp_path / "inf").values("training")["scheduler"]["best"] == float(
            "inf")
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, step=3)

    model2 = mlp(1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    sched2 = SCHEDULERS[name](opt2)
    ucpt.load(tmp_path / "c", model=model2, optimizer=opt2, scheduler=sched2)
    assert_same(sched.state_dict(), sched2.state_dict(), "scheduler")
    assert_same(opt.state_dict(), opt2.state_dict(), "optimizer")
    assert train(model, opt, sched, range(3, 6), plateau) == train(
        model2, opt2, sched2, range(3, 6), plateau
    )
    assert_same(model.state_dict(), model2.state_dict(), "model")


def test_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    """Train N steps, save, load into fresh objects, train M more: same as N+M at once."""

    def fresh(seed: int) -> tuple[Any, Any, Any]:
        model = mlp(seed, dropout=0.3)
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
                {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
                 "weight_decay": 0.0},
            ],
            lr=2e-2,
        )
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12)

    torch.manual_seed(42)
    ref_model, ref_opt, ref_sched = fresh(0)
    ref_losses = train(ref_model, ref_opt, ref_sched, range(12))

    torch.manual_seed(42)
    model, opt, sched = fresh(0)
    losses = train(model, opt, sched, range(5))
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, step=5,
              extra={"rng": {"torch_cpu": torch.get_rng_state()},
                     "data": {"epoch": 0, "offset": 40, "order": torch.arange(10)}})
    del model, opt, sched

    torch.manual_seed(1234)  # anything: the RNG state comes from the checkpoint
    model, opt, sched = fresh(7)
    result = ucpt.load(tmp_path / "c", model=model, optimizer=opt, scheduler=sched)
    torch.set_rng_state(result.training["rng"]["torch_cpu"])
    assert result.step == 5 and result.training["data"]["offset"] == 40
    assert result.training["data"]["order"].tolist() == list(range(10))
    losses += train(model, opt, sched, range(result.step, 12))

    assert losses == ref_losses  # exact float equality, step by step
    assert_same(ref_model.state_dict(), model.state_dict(), "model")
    assert_same(ref_opt.state_dict(), opt.state_dict(), "optimizer")


# -- save / load: what is read, and what does not fit -----------------------------------------


def test_model_only_load_reads_no_optimizer_byte(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, None, range(2))
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, step=2)
    ckpt = ucpformat.open(tmp_path / "c")

    def stored_objects(group: str) -> list[Path]:
        return [p for p in (tmp_path / "c" / group).rglob("*")
                if p.is_file() and p.name != "zarr.json"]

    model_bytes = sum(p.stat().st_size for p in stored_objects("model"))
    opt_files = stored_objects("optimizer")
    assert opt_files and model_bytes > 0
    model2 = mlp(1)
    result = ucpt.load(ckpt, model=model2)
    assert result.bytes_read == ckpt.stats.bytes_read == model_bytes
    assert_same(model.state_dict(), model2.state_dict())
    # and with every optimizer object gone, a model-only load still works
    for p in opt_files:
        p.unlink()
    model3 = mlp(2)
    assert ucpt.load(tmp_path / "c", model=model3).step == 2
    assert_same(model.state_dict(), model3.state_dict())
    model4 = mlp(3)
    with pytest.raises(ucpformat.errors.MissingChunkError, match="optimizer/state/"):
        ucpt.load(tmp_path / "c", model=model4, optimizer=torch.optim.Adam(model4.parameters()))


def test_strict_false_reports_missing_and_unexpected_keys(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, None, range(1))
    ucpt.save(tmp_path / "c", model=model, optimizer=opt)

    other = mlp(1)
    other[1] = torch.nn.Identity()  # the LayerNorm "1.*" is in the checkpoint only
    other.extra = torch.nn.Linear(2, 2)  # not in the checkpoint
    other_opt = torch.optim.SGD(other.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(KeyMismatchError, match=r"extra\.weight.*1\.weight|1\.weight.*extra"):
        ucpt.load(tmp_path / "c", model=other)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(KeyMismatchError, match=r"extra\.weight"):
        ucpt.load(tmp_path / "c", model=other, optimizer=other_opt)
    assert_same(before, dict(other.state_dict()))  # a failed load modifies nothing

    result = ucpt.load(tmp_path / "c", model=other, optimizer=other_opt, strict=False)
    assert sorted(result.missing_keys) == ["extra.bias", "extra.weight"]
    assert sorted(result.unexpected_keys) == ["1.bias", "1.weight"]
    assert sorted(result.missing_optimizer_params) == ["extra.bias", "extra.weight"]
    assert sorted(result.unexpected_optimizer_params) == ["1.bias", "1.weight"]
    assert_same(other[0].weight, model[0].weight)
    assert other_opt.param_groups[0]["lr"] == 0.1  # hyperparameters of the saved group
    assert_same(other_opt.state[other[0].weight]["momentum_buffer"],
                opt.state[model[0].weight]["momentum_buffer"])
    assert other.extra.weight not in other_opt.state


def test_absent_parts_are_errors_unless_strict_is_false(tmp_path: Path) -> None:
    model = mlp(0)
    ucpt.save(tmp_path / "c", model=model, step=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, None, range(1))
    before = {k: dict(v) for k, v in opt.state_dict()["state"].items()}
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with pytest.raises(KeyMismatchError, match="no optimizer group"):
        ucpt.load(tmp_path / "c", model=model, optimizer=opt)
    with pytest.raises(KeyMismatchError, match="no scheduler state"):
        ucpt.load(tmp_path / "c", model=model, scheduler=sched)
    result = ucpt.load(tmp_path / "c", model=model, optimizer=opt, scheduler=sched, strict=False)
    assert result.missing_optimizer_params == [n for n, _ in model.named_parameters()]
    assert_same(before, opt.state_dict()["state"])  # the optimizer keeps its own state
    with pytest.raises(InvalidValueError, match=r"extra.*step"):
        ucpt.save(tmp_path / "d", step=3, extra={"step": 4})


def test_shape_mismatch_names_the_tensor_and_modifies_nothing(tmp_path: Path) -> None:
    ucpt.save(tmp_path / "c", model=mlp(0))
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(), torch.nn.Dropout(0.0),
        torch.nn.Linear(16, 4),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ShapeMismatchError, match=r"model/4\.weight.*\[3, 16\].*\[4, 16\]"):
        ucpt.load(tmp_path / "c", model=model, strict=False)
    assert_same(before, dict(model.state_dict()))
    # the optimizer alone (named by torch's param_names): its per-element states
    src = mlp(0)
    src_opt = torch.optim.Adam(src.named_parameters())
    train(src, src_opt, None, range(1))
    ucpt.save(tmp_path / "o", model=src, optimizer=src_opt)
    opt = torch.optim.Adam(model.named_parameters())
    with pytest.raises(ShapeMismatchError, match=r"optimizer/state/4\.weight/exp_avg.*\[4, 16\]"):
        ucpt.load(tmp_path / "o", optimizer=opt)
    assert opt.state_dict()["state"] == {}


def test_optimizer_parameter_outside_the_model_is_refused(tmp_path: Path) -> None:
    model = mlp(0)
    stray = torch.nn.Parameter(torch.zeros(5, 7))
    opt = torch.optim.SGD([*model.parameters(), stray], lr=0.1)
    with pytest.raises(InvalidValueError, match=r"params\[6\].*\[5, 7\].*not a parameter"):
        ucpt.save(tmp_path / "c", model=model, optimizer=opt)
    with pytest.raises(InvalidValueError, match="pass model="):
        ucpt.save(tmp_path / "d", optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_optimizer_state_is_matched_by_name_not_by_position(tmp_path: Path) -> None:
    model = mlp(0)
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.Adam([{"params": weights}, {"params": biases, "lr": 0.5}], lr=0.01)
    train(model, opt, None, range(2))
    ucpt.save(tmp_path / "c", model=model, optimizer=opt)

    model2 = mlp(1)
    w2 = [p for n, p in model2.named_parameters() if n.endswith("weight")]
    b2 = [p for n, p in model2.named_parameters() if n.endswith("bias")]
    # groups in the other order, parameters reversed inside each group
    opt2 = torch.optim.Adam([{"params": b2[::-1]}, {"params": w2[::-1]}], lr=0.3)
    ucpt.load(tmp_path / "c", model=model2, optimizer=opt2)
    assert [g["lr"] for g in opt2.param_groups] == [0.5, 0.01]
    names1 = dict(model.named_parameters())
    for fqn, p2 in model2.named_parameters():
        assert_same(opt.state[names1[fqn]], opt2.state[p2], fqn)

    with pytest.raises(LoadError, match=r"torch\.optim\.adam\.Adam.*SGD"):
        ucpt.load(tmp_path / "c", optimizer=torch.optim.SGD(model2.parameters(), lr=1),
                  model=model2)


def test_save_before_the_first_step_and_named_optimizer(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)  # keeps param_names
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, step=0)
    ckpt = ucpformat.open(tmp_path / "c")
    assert {"optimizer", "training"} <= set(ckpt.groups)
    assert ckpt.values("optimizer")["param_groups"][0]["param_names"][0] == "0.weight"
    opt2 = torch.optim.AdamW(mlp(1).named_parameters(), lr=1e-3)
    ucpt.load(ckpt, optimizer=opt2)  # names from param_names: no model needed
    assert_same(opt.state_dict(), opt2.state_dict())
    assert ucpt.read_optimizer_state(ckpt)["state"] == {}


class CountingSGD(torch.optim.SGD):
    """An optimizer with non-tensor per-parameter state (a Python int and a float)."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                s = self.state[p]
                s["count"] = s.get("count", 0) + 1
                s["ratio"] = 0.5
        return out


def test_non_tensor_per_parameter_state_and_extra_state(tmp_path: Path) -> None:
    class WithExtra(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calls": getattr(self, "calls", 0), "mode": "fast"}

        def set_extra_state(self, state: Any) -> None:
            self.calls = state["calls"]

    class TensorExtra(torch.nn.Module):  # extra state that is a tensor
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.zeros(4, dtype=torch.int16)

        def get_extra_state(self) -> Any:
            return self.table

        def set_extra_state(self, state: Any) -> None:
            self.table = state.clone()

        def forward(self, x: Any) -> Any:
            return x

    model = torch.nn.Sequential(WithExtra(3, 2), TensorExtra())
    model[0].calls = 5
    model[1].table += 3
    opt = CountingSGD(model.parameters(), lr=0.1)  # no momentum: no tensor state at all
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    ucpt.save(tmp_path / "c", model=model, optimizer=opt)
    ckpt = ucpformat.open(tmp_path / "c")
    assert ckpt.values("optimizer/state/0.weight") == {"count": 1, "ratio": 0.5}
    assert ckpt.values("model")["0._extra_state"] == {"calls": 5, "mode": "fast"}
    assert ucpformat.validate(tmp_path / "c").valid

    assert ckpt["model/1._extra_state"].attributes["role"] == "buffer"

    model2 = torch.nn.Sequential(WithExtra(3, 2), TensorExtra())
    opt2 = CountingSGD(model2.parameters(), lr=0.1)
    ucpt.load(ckpt, model=model2, optimizer=opt2)
    assert model2[0].calls == 5
    assert model2[1].table.tolist() == [3, 3, 3, 3]
    assert_same(opt.state_dict(), opt2.state_dict())


def test_load_state_dict_and_read_optimizer_state(tmp_path: Path) -> None:
    model = mlp(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, None, range(1))
    ucpt.save(tmp_path / "c", model=model, optimizer=opt, extra={"rng": torch.get_rng_state()})
    sd = ucpt.load_state_dict(tmp_path / "c")
    assert_same(dict(model.state_dict()), sd)
    fresh = mlp(1)
    fresh.load_state_dict(sd)
    osd = ucpt.read_optimizer_state(tmp_path / "c")
    assert osd["type"] == "torch.optim.adam.Adam"
    assert osd["param_groups"][0]["params"] == [n for n, _ in model.named_parameters()]
    assert_same(osd["state"]["0.weight"]["exp_avg"], opt.state[model[0].weight]["exp_avg"])
    assert ucpt.load_state_dict(tmp_path / "c", prefix="training")["rng"].dtype == torch.uint8
    with pytest.raises(ucpformat.errors.TensorNotFoundError):
        ucpt.load_state_dict(tmp_path / "c", prefix="nothing")


def test_multistep_milestones_keep_integer_keys(tmp_path: Path) -> None:
    opt = torch.optim.SGD(mlp(0).parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 5, 5])
    ucpt.save(tmp_path / "c", scheduler=sched)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[1])
    ucpt.load(tmp_path / "c", scheduler=sched2)
    assert sched2.milestones == collections.Counter({3: 1, 5: 2})
    assert isinstance(sched2.milestones, collections.Counter)


def test_format_core_never_imports_torch(tmp_path: Path) -> None:
    code = (
        "import sys, numpy as np, ucpformat\n"
        f"ucpformat.save({str(tmp_path / 'c')!r}, {{'model': {{'w': np.ones(2)}}}})\n"
        f"ucpformat.open({str(tmp_path / 'c')!r})['model/w'].read()\n"
        "assert 'torch' not in sys.modules, 'the core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
