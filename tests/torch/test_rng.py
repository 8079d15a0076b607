"""ucpformat.torch.rng_state / set_rng_state and save(rng=True) / load(rng=True)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402

import ucpformat  # noqa: E402
import ucpformat.torch as ucpt  # noqa: E402
from ucpformat.checkpoint.tree import Group  # noqa: E402
from ucpformat.errors import KeyMismatchError, LoadError  # noqa: E402

pytestmark = pytest.mark.torch


def draws(gens: dict[str, Any] | None = None) -> list[Any]:
    """What each global generator (and each of ``gens``) gives next."""
    out: list[Any] = [random.random(), np.random.random(), torch.rand(4)]
    for g in (gens or {}).values():
        if isinstance(g, torch.Generator):
            out.append(torch.rand(4, generator=g))
        elif isinstance(g, random.Random):
            out.append(g.random())
        else:
            out.append(g.random(4))
    return out


def equal(a: list[Any], b: list[Any]) -> bool:
    return all(bool(np.array_equal(np.asarray(x), np.asarray(y)))
               for x, y in zip(a, b, strict=True))


def own_generators(seed: int) -> dict[str, Any]:
    return {"data": np.random.default_rng(seed),
            "philox": np.random.Generator(np.random.Philox(seed)),
            "legacy": np.random.RandomState(seed), "py": random.Random(seed),
            "dropout": torch.Generator().manual_seed(seed)}


def test_save_and_load_restore_every_generator_exactly(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    mine = own_generators(4)
    draws(mine)  # states that are not fresh seeds
    model = torch.nn.Linear(3, 2)  # built before the capture: init draws from torch
    before = {"python": random.getstate(), "numpy": np.random.get_state(),
              "torch": torch.get_rng_state()}
    ucpt.save(tmp_path / "c", model=model, rng=ucpt.rng_state(generators=mine))
    expected = draws(mine)

    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    fresh = own_generators(0)
    result = ucpt.load(tmp_path / "c", model=model, rng=True)
    # the global generators are back as they were saved, type for type
    assert random.getstate() == before["python"]
    restored = np.random.get_state()  # the legacy tuple numpy gives
    assert restored[0] == before["numpy"][0] and np.array_equal(restored[1], before["numpy"][1])
    assert restored[2:] == before["numpy"][2:]
    assert torch.equal(torch.get_rng_state(), before["torch"])
    assert isinstance(result.rng, dict) and isinstance(result.rng["python"], tuple)
    random.setstate(result.rng["python"])  # what failed on a list before
    # a run's own generators, from the result
    ucpt.set_rng_state(result.rng, generators=fresh)
    assert equal(draws(fresh), expected)


def test_load_without_rng_changes_no_generator(tmp_path: Path) -> None:
    ucpt.save(tmp_path / "c", rng=True)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    result = ucpt.load(tmp_path / "c")
    assert torch.equal(torch.get_rng_state(), state)
    assert result.rng is not None and "torch_cpu" in result.rng


def test_rng_true_needs_a_stored_state(tmp_path: Path) -> None:
    ucpt.save(tmp_path / "c", model=torch.nn.Linear(2, 2), step=1)
    with pytest.raises(KeyMismatchError, match="training/rng"):
        ucpt.load(tmp_path / "c", rng=True)
    assert ucpt.load(tmp_path / "c", rng=True, strict=False).rng is None


def test_a_broken_state_fails_the_load_before_anything_changes(tmp_path: Path) -> None:
    bad = Group(python=Group(kind="python", version=3, state=[1, 2], gauss_next="x"))
    ucpformat.save(tmp_path / "c", {"training": {"rng": bad}}, durable=False)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    with pytest.raises(ucpformat.errors.FormatError, match="R085"):
        ucpt.load(tmp_path / "c", rng=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert ucpt.load(tmp_path / "c").rng is None  # not asked for: not decoded, no error


def _two_devices(tmp_path: Path) -> list[Any]:
    """Save the states of two CUDA devices, as a 2-GPU run does; the states saved."""
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    fake = [torch.cuda.get_rng_state(0) if devices else torch.get_rng_state()] * 2
    ucpt.save(tmp_path / "c", rng={**ucpt.rng_state(), "torch_cuda": fake})
    return fake


def test_cuda_states_round_trip_and_missing_devices_are_refused(tmp_path: Path) -> None:
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert len(ucpt.rng_state().get("torch_cuda", [])) == devices
    fake = _two_devices(tmp_path)
    result = ucpt.load(tmp_path / "c")
    assert result.rng is not None
    assert [torch.equal(a, b) for a, b in zip(result.rng["torch_cuda"], fake, strict=True)] \
        == [True, True]
    if devices < 2:
        with pytest.raises(LoadError, match="CUDA generators of 2 devices"):
            ucpt.load(tmp_path / "c", rng=True)
        ucpt.load(tmp_path / "c", rng=True, strict=False)  # restores the others


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_generators_are_restored(tmp_path: Path) -> None:
    fake = _two_devices(tmp_path)
    torch.cuda.manual_seed_all(123)
    ucpt.load(tmp_path / "c", rng=True, strict=False)
    assert torch.equal(torch.cuda.get_rng_state(0), fake[0])


def test_named_generators_are_checked(tmp_path: Path) -> None:
    state = ucpt.rng_state(generators={"data": np.random.default_rng(1)})
    with pytest.raises(KeyMismatchError, match="sampler"):
        ucpt.set_rng_state(state, generators={"sampler": np.random.default_rng(2)})
    with pytest.raises(LoadError, match="does not fit"):
        ucpt.set_rng_state(state, generators={"data": torch.Generator()})
    with pytest.raises(ucpformat.errors.InvalidValueError, match="not a generator"):
        ucpt.rng_state(generators={"x": 3})  # type: ignore[dict-item]
