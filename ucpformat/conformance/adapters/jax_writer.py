"""A writer adapter of the conformance suite over the JAX path (``ucpformat.jax``).

    python -m ucpformat.conformance.adapters.jax_writer capabilities
    python -m ucpformat.conformance.adapters.jax_writer write SCENARIO_JSON OUT_DIR

Each scenario tensor is assembled from the scenario's per-rank local files (any source
layout: its boxes are checked to cover the tensor, UCP-1.0-R131), laid out as a
``jax.Array`` on a (2, 4) mesh of 8 virtual CPU devices with the first PartitionSpec that
divides its shape, and written as ``ucpformat.jax.save`` writes arrays: each distinct
device box once (:func:`ucpformat.jax.save.shard_parts`), through the one distributed
save (:class:`ucpformat.distributed.pipeline.DistributedSave`). 64-bit types need
``jax_enable_x64``, which the adapter turns on. Scenario names are kept as they are
(this adapter tests the JAX path's boxes and writes, not its naming of a training
state).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # before JAX starts its backend
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import numpy as np  # noqa: E402

from ucpformat._version import __version__  # noqa: E402
from ucpformat.conformance.adapters.reference import (  # noqa: E402
    EXIT_ADAPTER,
    EXIT_OK,
    EXIT_REFUSED,
    tensor_values,
)
from ucpformat.errors import UCPError  # noqa: E402
from ucpformat.format import dtypes, jsonvalues, names  # noqa: E402
from ucpformat.layout.boxes import as_slices, box_shape  # noqa: E402
from ucpformat.optional import require  # noqa: E402


def capabilities() -> dict[str, Any]:
    return {
        "name": "ucpformat.jax",
        "version": __version__,
        "roles": ["writer"],
        "data_types": list(dtypes.NAMES),
        "features": ["dtensor", "layout"],
    }


def _spec(shape: tuple[int, ...]) -> Any:
    P: Any = require("jax.sharding", extra="jax", purpose="the JAX writer adapter").PartitionSpec

    for spec in (P("a", "b"), P(("a", "b")), P(None, "b"), P("a"), P("b")):
        if len(spec) <= len(shape) and all(
                n % {None: 1, "a": 2, "b": 4, ("a", "b"): 8}[axis] == 0
                for axis, n in zip(spec, shape, strict=False)) and all(shape):
            return spec
    return P()


def write(scenario_path: str | Path, out_dir: str | Path) -> None:
    """Write a scenario's tensors as sharded jax.Arrays through the JAX save path."""
    jax = require("jax", extra="jax", purpose="the JAX writer adapter")
    jax.config.update("jax_enable_x64", True)
    sharding = require("jax.sharding", extra="jax", purpose="the JAX writer adapter")
    Mesh, NamedSharding = sharding.Mesh, sharding.NamedSharding

    from ucpformat.checkpoint.options import SaveOptions
    from ucpformat.distributed.comm import SingleProcess
    from ucpformat.distributed.pipeline import DistributedSave
    from ucpformat.distributed.rank_description import TensorSpec
    from ucpformat.distributed.shard_grid import check_coverage
    from ucpformat.jax.save import Collected, shard_parts

    scenario_path = Path(scenario_path)
    doc = json.loads(scenario_path.read_text(encoding="utf-8"))
    base = scenario_path.parent
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    collected = Collected()
    for entry in doc["tensors"]:
        path = names.path_of(*entry["name"])
        ucp = dict(entry.get("ucp", {}))
        shape = tuple(int(n) for n in entry["shape"])
        dt = dtypes.by_name(entry["dtype"])
        collected.specs.append(TensorSpec(path, shape, dt.name, {"ucp": ucp} if ucp else {}))
        pieces = tensor_values(entry, base)
        check_coverage(path, shape, [box for _, box, _ in pieces])
        full = np.zeros(shape, dtype=dt.numpy)
        for _, box, values in pieces:
            full[as_slices(box)] = np.asarray(values).reshape(box_shape(box))
        array = jax.make_array_from_callback(
            shape, NamedSharding(mesh, _spec(shape)), lambda index, f=full: f[index])
        if array.dtype != full.dtype:
            raise UCPError(f"JAX holds this {dt.name} tensor as {array.dtype}", tensor=path)
        parts = shard_parts(array)
        if parts:
            collected.parts[path] = parts
    root_values: dict[str, Any] = {}
    for group in doc.get("groups", []):
        values = jsonvalues.decode(group.get("values", {}), where="values")
        if not group["name"]:
            root_values = values
            continue
        attrs: dict[str, Any] = dict(group.get("ucp", {}))
        if values:
            attrs["values"] = values
        collected.groups[names.path_of(*group["name"])] = attrs
    metadata = jsonvalues.decode(doc.get("metadata", {}), where="metadata")
    DistributedSave(out_dir, SingleProcess(), SaveOptions(hash_algorithm="sha256")).run(
        collected.specs, collected, group_attributes=collected.groups,
        root_values=root_values or None, metadata=metadata or None)


def _print(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        if args == ["capabilities"]:
            _print(capabilities())
            return EXIT_OK
        if len(args) == 3 and args[0] == "write":
            try:
                write(args[1], args[2])
            except UCPError as exc:
                doc: dict[str, Any] = {"message": str(exc)}
                if exc.rule:
                    doc["rule"] = exc.rule
                _print({"error": doc})
                return EXIT_REFUSED
            return EXIT_OK
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"jax writer adapter: {type(exc).__name__}: {exc}\n")
        return EXIT_ADAPTER
    sys.stderr.write("usage: jax_writer capabilities | write SCENARIO OUT_DIR\n")
    return EXIT_ADAPTER


if __name__ == "__main__":
    sys.exit(main())
