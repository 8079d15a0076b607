"""The reference adapter: reader, writer and validator of the suite, built on ucpformat.

    python -m ucpformat.conformance.adapters.reference capabilities
    python -m ucpformat.conformance.adapters.reference read CHECKPOINT REQUEST_JSON
    python -m ucpformat.conformance.adapters.reference read-batch BATCH_JSON
    python -m ucpformat.conformance.adapters.reference write SCENARIO_JSON OUT_DIR
    python -m ucpformat.conformance.adapters.reference validate CHECKPOINT
    python -m ucpformat.conformance.adapters.reference validate-rules RULES_JSON APPLY_JSON

The command-line contract is in spec/ucp-1.0-conformance.md; adapters for other
implementations copy its shape, not its code.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat._version import __version__
from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.conformance import contents
from ucpformat.conformance.layouts import Target, local_from_checkpoint, source_maps
from ucpformat.errors import UCPError
from ucpformat.format import dtypes, jsonvalues, names
from ucpformat.layout.boxes import as_slices
from ucpformat.layout.semantics import TensorLayout, layout_of

EXIT_OK, EXIT_REFUSED, EXIT_ADAPTER = 0, 1, 2


def capabilities() -> dict[str, Any]:
    return {
        "name": "ucpformat",
        "version": __version__,
        "roles": ["reader", "writer", "validator"],
        "data_types": list(dtypes.NAMES),
        "features": ["archive", "batch", "dtensor", "layout", "rules"],
    }


def _error(exc: BaseException) -> dict[str, Any]:
    rule = getattr(exc, "rule", None)
    doc: dict[str, Any] = {"message": str(exc)}
    if rule:
        doc["rule"] = rule
    return doc


# -- reader -------------------------------------------------------------------------------------


def _read_selection(ckpt: Checkpoint, path: str, selection: Sequence[Sequence[int]]
                    ) -> np.ndarray[Any, Any]:
    tensor = ckpt[path]
    contents.as_index(selection, tensor.shape)  # checks the selection
    starts, stops = contents.box_of(selection)
    box = tensor.read_region(starts, stops)
    rel = [[0, n, int(step)] for n, (_a, _b, step) in zip(box.shape, selection, strict=True)]
    return contents.select(box, rel)


def read(checkpoint: str | Path, request: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The response to a reader request, and whether anything was refused."""
    try:
        ckpt = open_checkpoint(checkpoint)
    except UCPError as exc:
        return {"error": _error(exc)}, True
    refused = False
    out: dict[str, Any] = {}
    with ckpt:
        for path in sorted(ckpt.arrays):
            meta = ckpt.arrays[path]
            out[path] = {"dtype": meta.dtype.name, "shape": list(meta.shape)}
        for path, req in request.get("tensors", {}).items():
            entry = out.setdefault(path, {})
            if path not in ckpt:
                entry["error"] = {"message": f"no tensor {path!r} in this checkpoint"}
                refused = True
                continue
            try:
                if req.get("whole"):
                    entry["sha256"] = contents.sha256(ckpt[path].read())
                entry["slices"] = [
                    contents.sha256(_read_selection(ckpt, path, sel))
                    for sel in req.get("slices", [])
                ]
            except UCPError as exc:
                entry.pop("sha256", None)
                entry.pop("slices", None)
                entry["error"] = _error(exc)
                refused = True
        response: dict[str, Any] = {"tensors": out}
        values = {"": ckpt.root.ucp.get("values", {})}
        for gpath, group in sorted(ckpt.groups.items()):
            values[gpath] = dict(group.values)
        response["values"] = values
        response["metadata"] = ckpt.ucp.get("metadata", {})
        if request.get("targets"):
            targets: dict[str, Any] = {}
            for target in request["targets"]:
                try:
                    targets[target["id"]] = _target(ckpt, target)
                except UCPError as exc:
                    targets[target["id"]] = {"error": _error(exc)}
            response["targets"] = targets
    return response, refused


def _target(ckpt: Checkpoint, target: Mapping[str, Any]) -> dict[str, Any]:
    path = target["tensor"]
    tensor = ckpt[path]
    layout = layout_of(tensor.attributes, tensor.shape, tensor=path)
    lmap = Target.from_json(target.get("config", {})).local_map(tensor.shape, layout,
                                                               tensor=path)
    if lmap is None:
        return {"held": False}
    local = local_from_checkpoint(ckpt, path, lmap)
    return {"held": True, "shape": list(local.shape), "sha256": contents.sha256(local)}


def read_batch(batch: Mapping[str, Any]) -> dict[str, Any]:
    results = {}
    for item in batch.get("cases", []):
        response, _ = read(item["checkpoint"], item.get("request", {}))
        results[item["id"]] = response
    return {"results": results}


# -- writer -------------------------------------------------------------------------------------


def tensor_values(entry: Mapping[str, Any], base: Path) -> list[tuple[int, Any, Any]]:
    """(rank, box, values) fragments of one scenario tensor."""
    dt = dtypes.by_name(entry["dtype"])
    shape = tuple(int(s) for s in entry["shape"])
    content = entry["content"]
    generator = content["generator"]
    full_box = tuple((0, n) for n in shape)
    if generator == "splitmix64":
        return [(0, full_box, contents.generate(dt.name, shape, int(content["seed"])))]
    if generator == "zeros":
        return [(0, full_box, contents.zeros(dt.name, shape))]
    if generator != "local":
        raise ValueError(f"unknown content generator {generator!r}")
    layout = TensorLayout.from_json(entry.get("ucp", {}).get("layout", {}))
    path = names.path_of(*entry["name"])
    maps = source_maps(content["source"], shape, layout, tensor=path)
    out: list[tuple[int, Any, Any]] = []
    for local in content["locals"]:
        rank = int(local["rank"])
        raw = (base / local["file"]).read_bytes()
        arr = np.frombuffer(raw, dtype=dt.numpy).reshape(tuple(local["shape"]))
        lmap = maps[rank]
        for piece in lmap.pieces:
            out.append((rank, piece.glob, np.ascontiguousarray(arr[as_slices(piece.local)])))
    return out


def write(scenario_path: str | Path, out_dir: str | Path) -> None:
    """Write a scenario as a distributed save: each source rank writes its own fragments."""
    from ucpformat.distributed import Fragment, TensorSpec, save_fragments
    from ucpformat.distributed.comm import ThreadGroup, run_threads

    scenario_path = Path(scenario_path)
    doc = json.loads(scenario_path.read_text(encoding="utf-8"))
    base = scenario_path.parent
    specs: list[TensorSpec] = []
    fragments: dict[int, list[Fragment]] = {}
    for entry in doc["tensors"]:
        path = names.path_of(*entry["name"])
        ucp = dict(entry.get("ucp", {}))
        specs.append(TensorSpec(path, tuple(entry["shape"]), entry["dtype"],
                                {"ucp": ucp} if ucp else {}))
        for rank, box, values in tensor_values(entry, base):
            fragments.setdefault(rank, []).append(Fragment(path, box, values))
    group_attributes: dict[str, dict[str, Any]] = {}
    root_values: dict[str, Any] = {}
    for group in doc.get("groups", []):
        values = jsonvalues.decode(group.get("values", {}), where="values")
        if not group["name"]:
            root_values = values
            continue
        attrs: dict[str, Any] = dict(group.get("ucp", {}))
        if values:
            attrs["values"] = values
        group_attributes[names.path_of(*group["name"])] = attrs
    metadata = jsonvalues.decode(doc.get("metadata", {}), where="metadata")
    world = max([1, *(r + 1 for r in fragments)])

    def rank_main(comm: ThreadGroup) -> None:
        save_fragments(
            out_dir, comm, specs=specs if comm.rank == 0 else [],
            fragments=fragments.get(comm.rank, []),
            group_attributes=group_attributes if comm.rank == 0 else None,
            root_values=root_values or None, metadata=metadata or None,
            hash_algorithm="sha256",
        )

    run_threads(world, rank_main)


# -- validator ----------------------------------------------------------------------------------


def validate(checkpoint: str | Path) -> dict[str, Any]:
    from ucpformat.checkpoint.validation import validate as _validate

    return _validate(checkpoint, deep=True).to_json()


def validate_rules(rules_path: str | Path, apply_path: str | Path | None) -> dict[str, Any]:
    """Validate a rule file (UCP-1.0-R120), its expressions (UCP-1.0-R121) and its coverage of
    names (UCP-1.0-R122).

    ``apply_path`` (parameters and names to resolve) is optional: without it, only the
    file itself is checked.
    """
    from ucpformat.layout.rules import RuleSet

    errors: list[dict[str, Any]] = []
    try:
        rules = RuleSet.from_json(json.loads(Path(rules_path).read_text(encoding="utf-8")),
                                  source=str(rules_path))
        apply = ({} if apply_path is None
                 else json.loads(Path(apply_path).read_text(encoding="utf-8")))
        for name in apply.get("names", []):
            try:
                rules.resolve(name, apply.get("params", {}))
            except UCPError as exc:
                errors.append({"rule": exc.rule, "path": name, "message": exc.message})
    except UCPError as exc:
        errors.append({"rule": exc.rule, "path": str(rules_path), "message": exc.message})
    except ValueError as exc:
        errors.append({"rule": "UCP-1.0-R120", "path": str(rules_path), "message": str(exc)})
    return {"valid": not errors, "errors": errors, "warnings": []}


# -- command line -------------------------------------------------------------------------------


def _print(doc: Any) -> None:
    sys.stdout.write(json.dumps(doc, ensure_ascii=False) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: reference capabilities | read CHECKPOINT REQUEST | read-batch BATCH | "
             "write SCENARIO OUT_DIR | validate CHECKPOINT | validate-rules RULES APPLY")
    if not args:
        sys.stderr.write(usage + "\n")
        return EXIT_ADAPTER
    command, rest = args[0], args[1:]
    try:
        if command == "capabilities" and not rest:
            _print(capabilities())
            return EXIT_OK
        if command == "read" and len(rest) == 2:
            request = json.loads(Path(rest[1]).read_text(encoding="utf-8"))
            response, refused = read(rest[0], request)
            _print(response)
            return EXIT_REFUSED if refused else EXIT_OK
        if command == "read-batch" and len(rest) == 1:
            _print(read_batch(json.loads(Path(rest[0]).read_text(encoding="utf-8"))))
            return EXIT_OK
        if command == "write" and len(rest) == 2:
            try:
                write(rest[0], rest[1])
            except UCPError as exc:
                _print({"error": _error(exc)})
                return EXIT_REFUSED
            return EXIT_OK
        if command == "validate" and len(rest) == 1:
            result = validate(rest[0])
            _print(result)
            return EXIT_OK if result["valid"] else EXIT_REFUSED
        if command == "validate-rules" and len(rest) == 2:
            result = validate_rules(rest[0], rest[1])
            _print(result)
            return EXIT_OK if result["valid"] else EXIT_REFUSED
    except (OSError, ValueError, KeyError) as exc:
        sys.stderr.write(f"reference adapter: {type(exc).__name__}: {exc}\n")
        return EXIT_ADAPTER
    sys.stderr.write(usage + "\n")
    return EXIT_ADAPTER


if __name__ == "__main__":
    sys.exit(main())
