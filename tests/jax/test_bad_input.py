"""Targets that do not fit are refused by leaf name before anything is read; states
that cannot be stored are refused by leaf name before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ucpformat
import ucpformat.jax as ucpj
from tests.jax.helpers import abstract, host_state, mesh, sharded_state
from ucpformat.errors import InvalidValueError, KeyMismatchError, ShapeMismatchError


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad") / "ckpt"
    ucpj.save(path, sharded_state(mesh("2x4")), step=2)
    return path


def _refused(saved: Path, target: Any, error: type[Exception], *words: str) -> None:
    ckpt = ucpformat.open_checkpoint(saved)
    with pytest.raises(error) as info:
        ucpj.load(ckpt, target)
    for word in words:
        assert word in str(info.value)
    assert ckpt.stats.bytes_read == 0 and ckpt.stats.requests == 0


def test_a_shape_that_differs_is_refused_by_leaf_name(saved: Path) -> None:
    target = abstract(host_state(), mesh("8"), rotate=0)
    target["params"]["blocks"]["layer5"] = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    _refused(saved, target, ShapeMismatchError, "params/blocks/layer5", "[16, 24]")


def test_a_dtype_that_differs_is_refused_by_leaf_name(saved: Path) -> None:
    target = abstract(host_state(), mesh("8"), rotate=0)
    adam = target["opt_state"][0]
    mu = {**adam.mu, "embed": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    target["opt_state"] = (adam._replace(mu=mu), *target["opt_state"][1:])
    _refused(saved, target, ShapeMismatchError, "opt_state/0/mu/embed", "bfloat16")


def test_a_leaf_the_checkpoint_lacks_is_refused_by_name(saved: Path) -> None:
    target = abstract(host_state(), mesh("8"), rotate=0)
    target["params"]["head"] = jax.ShapeDtypeStruct((4,), jnp.float32)
    _refused(saved, target, KeyMismatchError, "params/head", "model/head")


def test_a_leaf_that_is_no_array_nor_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match="note/f"):
        ucpj.save(tmp_path / "c", {"params": {"w": np.ones(2)}, "note": {"f": object()}})
    assert not (tmp_path / "c").exists()


def test_two_leaves_stored_in_one_place_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidValueError, match=r"model/a\.b"):
        ucpj.save(tmp_path / "c", {"params": {"a.b": np.ones(2), "a": {"b": np.ones(2)}}})
