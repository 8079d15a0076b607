"""Small JAX training states on meshes of the 8 virtual devices, and leaf comparisons."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

#: (mesh shape, axis names) of the meshes the tests save on and load onto.
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "8": ((8,), ("x",)),
    "2x4": ((2, 4), ("a", "b")),
    "4x2": ((4, 2), ("a", "b")),
    "1x8": ((1, 8), ("a", "b")),
}

#: PartitionSpecs of a 2-D (16, 24) parameter, for meshes of one axis and of two.
SPECS_1 = [P(), P("x"), P(None, "x"), P("x", None)]
SPECS_2 = [P(), P("a"), P(None, "b"), P(("a", "b")), P(("b", "a")), P("a", "b"),
           P("b", "a"), P(None, ("b", "a"))]


def mesh(name: str, devices: Any = None) -> Mesh:
    shape, axes = MESHES[name]
    devs = np.array(jax.devices() if devices is None else devices).reshape(shape)
    return Mesh(devs, axes)


def specs_for(m: Mesh) -> list[Any]:
    return SPECS_1 if len(m.axis_names) == 1 else SPECS_2


def params_values() -> dict[str, np.ndarray]:
    """The global values of the test model's parameters (one per PartitionSpec)."""
    rng = np.random.default_rng(7)
    out = {f"layer{i}": rng.standard_normal((16, 24)).astype(np.float32) for i in range(8)}
    out["embed"] = rng.standard_normal((8, 16)).astype(jnp.bfloat16)
    out["scale"] = np.arange(24, dtype=np.int32)
    return out


def sharded_state(m: Mesh, *, rotate: int = 0) -> dict[str, Any]:
    """A training state on mesh ``m``: params laid out with every PartitionSpec (shifted
    by ``rotate``), an AdamW state after one update laid out as its parameters, a PRNG
    key and a note. (The update runs once, on one device: no compilation per mesh.)"""
    specs = specs_for(m)
    shardings = {}
    for i, (name, value) in enumerate(params_values().items()):
        spec = specs[(i + rotate) % len(specs)] if value.ndim == 2 else P()
        shardings[name] = NamedSharding(m, spec)
    state = host_state()
    replicated = NamedSharding(m, P())

    def place(tree: Any) -> Any:  # each leaf laid out as the parameter of its name
        return jax.tree_util.tree_map_with_path(
            lambda path, v: put(v, shardings[path[-1].key]), tree)

    adam, *rest = state["opt_state"]
    opt_state = (adam._replace(count=put(adam.count, replicated),
                               mu=place(adam.mu), nu=place(adam.nu)), *rest)
    return {**state, "params": place(state["params"]), "opt_state": opt_state}


def put(value: Any, sharding: Any) -> Any:
    """``value`` (the same on every process) as a global array: each process builds
    only its own devices' shards (no communication)."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    return {"blocks": {k: v for k, v in flat.items() if k.startswith("layer")},
            "embed": flat["embed"], "scale": flat["scale"]}


_HOST: dict[str, Any] = {}


def host_state() -> dict[str, Any]:
    """The training state on the default device (computed once per session)."""
    if not _HOST:
        _HOST.update(train_state(nest(params_values())))
    return dict(_HOST)


def train_state(params: dict[str, Any]) -> dict[str, Any]:
    """Params, an AdamW state after one update (the int leaf has none), a key, a note."""
    tx = optax.adamw(1e-2)
    floats = jax.tree_util.tree_map(lambda p: p if jnp.issubdtype(p.dtype, jnp.floating)
                                    else None, params)
    opt_state = tx.init(floats)
    grads = jax.tree_util.tree_map(lambda p: jnp.cos(p.astype(jnp.float32)).astype(p.dtype),
                                   floats)
    _, opt_state = tx.update(grads, opt_state, floats)
    return {"params": params, "opt_state": opt_state, "rng": jax.random.key(42),
            "note": {"run": "matrix", "lr": 0.01}}


def abstract(state: dict[str, Any], m: Mesh, *, rotate: int) -> dict[str, Any]:
    """``state`` as ShapeDtypeStructs on mesh ``m``, arrays laid out with other specs."""
    specs = specs_for(m)
    counter = iter(range(1000))

    def one(leaf: Any) -> Any:
        if not hasattr(leaf, "shape") or jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            return leaf
        if leaf.ndim == 2:
            spec = specs[(next(counter) + rotate) % len(specs)]
        elif leaf.ndim == 1 and leaf.shape[0] % 8 == 0:
            spec = P(m.axis_names[-1])
        else:
            spec = P()
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(m, spec))

    return jax.tree_util.tree_map(one, state)


def host(leaf: Any) -> Any:
    if hasattr(leaf, "dtype") and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf) if hasattr(leaf, "shape") else leaf


def assert_bit_equal(expected: Any, got: Any) -> None:
    """Same structure, every array leaf of the same dtype and shape with the same bytes."""
    e_leaves, e_def = jax.tree_util.tree_flatten(expected)
    g_leaves, g_def = jax.tree_util.tree_flatten(got)
    assert e_def == g_def
    for e, g in zip(e_leaves, g_leaves, strict=True):
        e, g = host(e), host(g)
        if isinstance(e, np.ndarray):
            assert isinstance(g, np.ndarray) and e.dtype == g.dtype and e.shape == g.shape
            assert e.tobytes() == g.tobytes()
        else:
            assert e == g
