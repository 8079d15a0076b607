"""The training/rng convention (spec R085) without torch: Python's and NumPy's generators
stored and read back exactly, type for type; what breaks the convention is named."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint import rng
from ucpformat.checkpoint.tree import Group
from ucpformat.errors import FormatError, InvalidValueError

BIT_GENERATORS = [np.random.MT19937, np.random.PCG64, np.random.PCG64DXSM, np.random.Philox,
                  np.random.SFC64]


def same(a: Any, b: Any) -> bool:
    """Equal, type for type, arrays by value and dtype."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(
            same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def stored_and_read(tmp_path: Path, state: dict[str, Any]) -> dict[str, Any]:
    ucpformat.save(tmp_path / "c", {"training": {"rng": rng.encode(state)}}, durable=False)
    report = ucpformat.validate(tmp_path / "c")
    assert report.valid and not report.warnings, report.issues  # no R071 warning either
    with ucpformat.open(tmp_path / "c") as ckpt:
        return rng.decode(ckpt.to_dict("training/rng"))


def test_every_numpy_bit_generator_and_python_round_trip(tmp_path: Path) -> None:
    gens = {cls.__name__: np.random.Generator(cls(7)) for cls in BIT_GENERATORS}
    for g in gens.values():
        g.random(3)  # PCG64 and Philox hold a buffered half-word after odd draws
        g.integers(0, 10, 1, dtype=np.uint32)
    py = random.Random(3)
    py.gauss(0, 1)  # gauss_next is a float now
    legacy = np.random.RandomState(5)
    legacy.standard_normal()
    state = {
        "python": random.getstate(),
        "numpy": legacy.get_state(),  # the legacy tuple form is taken too
        "generators": {**{k: g.bit_generator.state for k, g in gens.items()},
                       "py": py.getstate(), "legacy": legacy.get_state(legacy=False)},
    }
    back = stored_and_read(tmp_path, state)
    assert same(back["python"], random.getstate())
    assert same(back["numpy"], legacy.get_state(legacy=False))
    assert same(back["generators"]["py"], py.getstate())  # (3, (...), 0.x): tuples
    assert back["generators"]["py"][2] is not None
    for name, g in gens.items():
        assert same(back["generators"][name], g.bit_generator.state), name
    # restored, each draws what the original draws
    for name, g in gens.items():
        other = np.random.Generator(type(g.bit_generator)(0))
        other.bit_generator.state = back["generators"][name]
        assert np.array_equal(other.random(5), g.random(5)), name
    restored = random.Random()
    restored.setstate(back["generators"]["py"])
    assert restored.gauss(0, 1) == py.gauss(0, 1)
    again = np.random.RandomState(0)
    again.set_state(back["numpy"])
    assert again.standard_normal() == legacy.standard_normal()


def test_the_layout_is_one_node_per_generator(tmp_path: Path) -> None:
    pcg = np.random.default_rng(1)
    state = {"numpy": np.random.get_state(legacy=False),
             "torch_cpu": np.arange(8, dtype=np.uint8),
             "torch_cuda": [np.zeros(4, np.uint8), np.ones(4, np.uint8)],
             "generators": {"loader": pcg.bit_generator.state, "sampler": np.ones(3, np.uint8)}}
    stored_and_read(tmp_path, state)
    with ucpformat.open(tmp_path / "c") as ckpt:
        assert sorted(ckpt.arrays) == [
            "training/rng/generators/sampler", "training/rng/numpy/state.key",
            "training/rng/torch_cpu", "training/rng/torch_cuda/0", "training/rng/torch_cuda/1"]
        loader = ckpt.values("training/rng/generators/loader")
        assert loader["state.state"] == str(pcg.bit_generator.state["state"]["state"])
        assert loader["kind"] == "numpy" and loader["bit_generator"] == "PCG64"


def test_what_is_not_a_generator_state_is_refused_by_name() -> None:
    with pytest.raises(InvalidValueError, match="no generator 'cuda'"):
        rng.encode({"cuda": np.zeros(3, np.uint8)})
    with pytest.raises(InvalidValueError, match="1-D uint8"):
        rng.encode({"torch_cpu": np.zeros(3, np.float32)})
    with pytest.raises(InvalidValueError, match=r"random\.getstate"):
        rng.encode({"python": [3, [1, 2], None]})
    with pytest.raises(InvalidValueError, match=r"bit_generator\.state"):
        rng.encode({"numpy": {"state": 1}})


def test_reading_a_broken_convention_names_the_node(tmp_path: Path) -> None:
    groups = {
        "python": Group(kind="numpy", version=3, state=[1], gauss_next=None),
        "numpy": Group(kind="numpy", bit_generator="PCG64", **{"state.state": 2.0**60}),
        "torch_cuda": Group({"1": np.zeros(3, np.uint8)}),
    }
    for name, group in groups.items():
        ucpformat.save(tmp_path / name, {"training": {"rng": Group({name: group})}},
                       durable=False)
        report = ucpformat.validate(tmp_path / name)
        assert {i.rule for i in report.errors} == {"UCP-1.0-R085"}, (name, report.issues)
        with ucpformat.open(tmp_path / name) as ckpt, pytest.raises(FormatError) as info:
            rng.decode(ckpt.to_dict("training/rng"))
        assert info.value.rule == "UCP-1.0-R085"
        assert info.value.path is not None and info.value.path.startswith(f"training/rng/{name}")


def test_an_rng_array_of_earlier_checkpoints_stays_valid(tmp_path: Path) -> None:
    """R083 allowed training/rng to be one uint8 array; R085 constrains only the group."""
    ucpformat.save(tmp_path / "c", {"training": {"rng": np.arange(16, dtype=np.uint8)}},
                   durable=False)
    assert ucpformat.validate(tmp_path / "c").valid
