"""Orbax PyTree checkpoints -> UCP, read through TensorStore.

Orbax (``StandardCheckpointer``, ``PyTreeCheckpointer``, ``ocp.v1.save_pytree``) writes
a directory holding ``_METADATA`` (JSON: every leaf's key path and value type) and the
arrays as zarr v2 or v3 inside an OCDBT key-value store, one array per leaf, named by
its key path joined by dots. This importer reads ``_METADATA`` (strictly: it is JSON,
never executed) and opens each array with TensorStore's ``zarr``/``zarr3`` driver over
``ocdbt``; values are read tensor by tensor when the engine writes them.

The leaves are placed as :func:`ucpformat.jax.save` places a JAX state
(:mod:`ucpformat.jax.tree`): ``params`` at ``model/<fqn>``, an Optax Adam state (a
mapping of ``count``, ``mu`` and ``nu``) at ``optimizer/state/<fqn>/exp_avg`` and
``exp_avg_sq`` with torch's float32 ``step``, other optimizer leaves at
``optimizer/optax/<path>``, ``step`` at the ``training`` group's value, other entries
under ``training/``. So an Orbax checkpoint converted here loads with
``ucpformat.jax.load`` (and, with a key map, in PyTorch).

The path may be the PyTree directory itself, or a checkpoint holding one item directory
(``ocp.v1``'s ``state/``, a ``CheckpointManager`` step's ``default/``).
"""

from __future__ import annotations

import json
from collections import namedtuple
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat.errors import FormatError
from ucpformat.format import dtypes
from ucpformat.importers._engine import Scan, TensorSource
from ucpformat.optional import require

FORMAT: Final = "orbax"
METADATA: Final = "_METADATA"
MAX_METADATA_BYTES: Final = 256 << 20

#: An Optax Adam state as :func:`ucpformat.jax.tree.is_adam` recognises it.
AdamState = namedtuple("AdamState", ["count", "mu", "nu"])


def _tree_dir(path: Path) -> Path | None:
    if (path / METADATA).is_file():
        return path
    if path.is_dir():
        items = [p for p in path.iterdir() if p.is_dir() and (p / METADATA).is_file()]
        if len(items) == 1:
            return items[0]
    return None


def detect(path: Path) -> bool:
    """A directory with Orbax's ``_METADATA`` (or one item directory holding it)."""
    return path.is_dir() and _tree_dir(path) is not None


class _Stored:
    """One Orbax array: shape and dtype from TensorStore, values read on request."""

    def __init__(self, store: Any, key: str) -> None:
        self.store = store
        self.key = key
        self.shape = tuple(int(n) for n in store.shape)
        self.dtype = np.dtype(store.dtype.numpy_dtype)

    def read(self) -> np.ndarray[Any, Any]:
        return np.asarray(self.store.read().result())


def _metadata(root: Path) -> dict[str, Any]:
    path = root / METADATA
    if path.stat().st_size > MAX_METADATA_BYTES:
        raise FormatError(f"{METADATA} is larger than {MAX_METADATA_BYTES} bytes", path=str(path))
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{METADATA} is not JSON: {exc}", path=str(path)) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
        raise FormatError(f"{METADATA} has no tree_metadata object", path=str(path))
    return doc


def _insert(tree: dict[str, Any], keys: list[str], value: Any, where: Path) -> None:
    node = tree
    for k in keys[:-1]:
        child = node.setdefault(k, {})
        if not isinstance(child, dict):
            raise FormatError(f"leaf {'.'.join(keys)} lies below another leaf", path=str(where))
        node = child
    if keys[-1] in node:
        raise FormatError(f"leaf {'.'.join(keys)} is listed twice", path=str(where))
    node[keys[-1]] = value


def _adam(tree: Any) -> Any:
    """The tree with every mapping of exactly count, mu and nu made an Adam state."""
    if not isinstance(tree, dict):
        return tree
    out = {k: _adam(v) for k, v in tree.items()}
    if set(out) == {"count", "mu", "nu"}:
        return AdamState(out["count"], out["mu"], out["nu"])
    return out


def _constant(value: np.ndarray[Any, Any]) -> Callable[[], np.ndarray[Any, Any]]:
    return lambda: value


def scan(path: Path, **_options: Any) -> Scan:
    """Every leaf of the Orbax PyTree at ``path``, placed as a JAX save places it."""
    ts = require("tensorstore", extra="jax", purpose="converting an Orbax checkpoint")
    from ucpformat.jax.tree import layout, param_fqns

    root = _tree_dir(path)
    if root is None:
        raise FormatError(f"no Orbax {METADATA} here", path=str(path))
    doc = _metadata(root)
    driver = "zarr3" if doc.get("use_zarr3") else "zarr"
    base = root.resolve().as_uri() + "/"
    kvstore = {"driver": "ocdbt", "base": base} if doc.get("use_ocdbt", True) else {
        "driver": "file", "path": str(root)}
    tree: dict[str, Any] = {}
    for entry in doc["tree_metadata"].values():
        keys = [str(k.get("key")) for k in entry.get("key_metadata", []) if isinstance(k, dict)]
        if not keys:
            raise FormatError("a leaf with no key path", path=str(root / METADATA))
        kind = entry.get("value_metadata", {}).get("value_type")
        if kind == "None":  # an empty subtree (a parameter with no optimizer state)
            continue
        if kind in ("jax.Array", "np.ndarray", "scalar"):
            name = ".".join(keys)
            spec = {"driver": driver, "kvstore": {**kvstore, "path": f"{name}/"}
                    if doc.get("use_ocdbt", True) else {**kvstore, "path": str(root / name)}}
            try:
                stored: Any = _Stored(ts.open(spec, open=True).result(), name)
            except Exception as exc:  # TensorStore's own errors
                raise FormatError(f"cannot open leaf {name!r} through TensorStore: {exc}",
                                  path=str(root)) from exc
            if kind == "scalar":
                stored = stored.read().item()
        elif kind == "string":
            raise FormatError(f"leaf {'.'.join(keys)} is a string, which Orbax keeps "
                              "outside the arrays; not supported", path=str(root))
        else:
            raise FormatError(f"leaf {'.'.join(keys)} has value type {kind!r}",
                              path=str(root))
        _insert(tree, keys, stored, root)
    result = Scan(format=FORMAT, source=str(path))
    result.metadata["orbax"] = {"custom_metadata": doc.get("custom_metadata")}
    leaves = layout(_adam(tree))
    for leaf in leaves:
        if leaf.kind == "value":
            result.group_values(leaf.path)[leaf.key] = leaf.value
        elif leaf.kind == "count":
            count = np.asarray(leaf.value.read(), dtype=np.float32)
            for step in leaf.steps:
                result.tensors.append(TensorSource(step, (), dtypes.by_name("float32"),
                                                   _constant(count),
                                                   {"ucp": {"role": "optimizer_state"}}))
        else:
            value: _Stored = leaf.value
            result.tensors.append(TensorSource(
                leaf.path, value.shape, dtypes.from_numpy(value.dtype, tensor=leaf.path),
                value.read, {"ucp": {"role": leaf.role}}))
    if any(t.path.startswith("optimizer/") for t in result.tensors):
        result.group_values("optimizer").update(
            {"type": "optax", "param_groups": [{"params": param_fqns(leaves)}]})
    return result


__all__ = ["FORMAT", "detect", "scan"]
