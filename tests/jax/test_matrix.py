"""Saves on meshes (8,), (2, 4) and (1, 8), with every PartitionSpec of helpers.SPECS_*,
loaded onto other meshes and other specs: every leaf bit-equal, Optax state included."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ucpformat
import ucpformat.jax as ucpj
from tests.jax.helpers import abstract, assert_bit_equal, jax, mesh, sharded_state
from ucpformat.errors import MissingChunkError
from ucpformat.jax.load import HOST_ALIGNMENT

CASES = [("8", "2x4"), ("2x4", "1x8"), ("1x8", "8"), ("2x4", "4x2")]


@pytest.mark.parametrize(("saved_on", "loaded_on"), CASES)
def test_save_on_one_mesh_load_on_another(tmp_path: Path, saved_on: str, loaded_on: str) -> None:
    state = sharded_state(mesh(saved_on))
    location = tmp_path / "ckpt"
    ucpj.save(location, state, step=11)
    report = ucpformat.validate(location, deep=True)
    assert report.valid and not report.issues, report.issues

    target_mesh = mesh(loaded_on)
    target = {**abstract(state, target_mesh, rotate=3), "step": 0}
    got = ucpj.load(location, target)
    assert got["step"] == 11
    del got["step"]
    assert_bit_equal(state, got)
    # every array is laid out as its target said
    for t, g in zip(jax.tree_util.tree_leaves(abstract(state, target_mesh, rotate=3)),
                    jax.tree_util.tree_leaves(got), strict=True):
        if isinstance(t, jax.ShapeDtypeStruct):
            assert g.sharding == t.sharding


def test_names_are_the_torch_integrations(tmp_path: Path) -> None:
    state = sharded_state(mesh("2x4"))
    ucpj.save(tmp_path / "c", state, step=5)
    ckpt = ucpformat.open_checkpoint(tmp_path / "c")
    keys = set(ckpt.keys())
    assert "model/blocks.layer0" in keys and "model/embed" in keys
    assert {"optimizer/state/blocks.layer3/exp_avg", "optimizer/state/blocks.layer3/exp_avg_sq",
            "optimizer/state/blocks.layer3/step"} <= keys
    # the int parameter has no Adam state; an Adam count is torch's float32 step
    assert not any(k.startswith("optimizer/state/scale/") for k in keys)
    step = ckpt["optimizer/state/embed/step"]
    assert step.dtype == np.float32 and step.read() == 1.0
    assert ckpt["model/blocks.layer0"].attributes["role"] == "parameter"
    assert ckpt.values("training") == {"step": 5}
    optimizer = ckpt.values("optimizer")
    assert optimizer["type"] == "optax"
    assert sorted(optimizer["param_groups"][0]["params"]) == sorted(
        ["embed", *(f"blocks.layer{i}" for i in range(8))])
    assert ckpt.values("training/note") == {"run": "matrix", "lr": 0.01}
    assert ckpt["training/rng"].attributes["prng_impl"] == "threefry2x32"


def test_replicas_are_written_once(tmp_path: Path) -> None:
    m = mesh("2x4")
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8), NamedSharding(m, P("a")))
    from ucpformat.jax.save import collect

    collected = collect({"params": {"w": x}}, rank=0)
    boxes = [b for p, b in collected.boxes() if p == "model/w"]
    assert sorted(boxes) == [((0, 4), (0, 8)), ((4, 8), (0, 8))]


def test_load_without_target_gives_host_arrays(tmp_path: Path) -> None:
    state = sharded_state(mesh("8"))
    ucpj.save(tmp_path / "c", state, step=3)
    got = ucpj.load(tmp_path / "c")
    assert got["step"] == 3
    np.testing.assert_array_equal(got["params"]["blocks"]["layer2"],
                                  np.asarray(state["params"]["blocks"]["layer2"]))
    mu = state["opt_state"][0].mu["embed"]
    stored = got["opt_state"]["state"]["embed"]["exp_avg"]
    assert isinstance(stored, np.ndarray) and stored.tobytes() == np.asarray(mu).tobytes()
    assert got["note"] == {"run": "matrix", "lr": 0.01}


def test_a_flax_train_state_round_trips(tmp_path: Path) -> None:
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from flax.training.train_state import TrainState

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            return nn.Dense(3)(nn.Dense(4)(x))

    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    state = state.apply_gradients(grads=jax.tree_util.tree_map(jnp.ones_like, params))
    ucpj.save(tmp_path / "c", state)
    ckpt = ucpformat.open_checkpoint(tmp_path / "c")
    assert "model/Dense_1.kernel" in ckpt and ckpt.values("training") == {"step": 1}
    assert ckpt["optimizer/state/Dense_0.kernel/step"].read() == 1.0
    got = ucpj.load(tmp_path / "c", jax.eval_shape(lambda: state))
    assert type(got) is TrainState and int(got.step) == 1
    assert_bit_equal({"p": state.params, "o": state.opt_state},
                     {"p": got.params, "o": got.opt_state})


def test_a_cpu_load_places_row_boxes_without_copying_them(tmp_path: Path) -> None:
    """Boxes of whole rows land in aligned host buffers that the CPU devices use as they
    are: the devices holding one replicated box share its memory; a box of columns is
    copied once, still bit-equal."""
    m = mesh("2x4")
    values = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    specs = {"rows": P("a"), "whole": P(), "columns": P(None, "b")}
    state = {"params": {k: jax.make_array_from_callback(
        values.shape, NamedSharding(m, s), lambda i: values[i]) for k, s in specs.items()}}
    ucpj.save(tmp_path / "c", state)
    target = {"params": {k: jax.ShapeDtypeStruct(values.shape, np.float32,
                                                 sharding=NamedSharding(m, s))
                         for k, s in specs.items()}}
    got = ucpj.load(tmp_path / "c", target)["params"]
    for name in specs:
        assert np.asarray(got[name]).tobytes() == values.tobytes(), name

    def pointers(array: Any) -> dict[Any, set[int]]:
        out: dict[Any, set[int]] = {}
        for shard in array.addressable_shards:
            out.setdefault(str(shard.index), set()).add(shard.data.unsafe_buffer_pointer())
        return out

    assert all(len(p) == 1 for p in pointers(got["rows"]).values())  # 4 devices, 1 buffer
    assert len(pointers(got["whole"])[str((slice(None), slice(None)))]) == 1
    assert all(p % HOST_ALIGNMENT == 0
               for ps in pointers(got["columns"]).values() for p in ps)


def test_a_load_in_many_batches_places_every_leaf(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each leaf its own batch (read, then placed in a thread while the next is read):
    the same arrays; a read that fails in a later batch raises, whatever was placed."""
    monkeypatch.setattr(sys.modules["ucpformat.jax.load"], "BATCH_BYTES", 1)
    state = sharded_state(mesh("2x4"))
    ucpj.save(tmp_path / "c", state, step=2, min_shard_bytes=0)
    target = {**abstract(state, mesh("4x2"), rotate=3), "step": 0}
    got = ucpj.load(tmp_path / "c", target)
    assert got.pop("step") == 2
    assert_bit_equal(state, got)
    nu = tmp_path / "c" / "optimizer" / "state" / "embed" / "exp_avg_sq"
    next(f for f in sorted(nu.rglob("*")) if f.is_file() and "c" in f.relative_to(nu).parts
         ).unlink()  # a shard of a leaf read in a later batch than the first
    with pytest.raises(MissingChunkError):
        ucpj.load(tmp_path / "c", target)
