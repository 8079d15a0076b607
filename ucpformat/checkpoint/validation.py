"""Validation of a checkpoint against the schemas and the spec's structural rules.

Every problem is an :class:`Issue` naming the requirement it breaks. MUST violations are
errors, SHOULD violations warnings. ``deep=True`` also reads every stored object,
checks every CRC32C and every SHA-256 of the manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Mapping, Set
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

from ucpformat.checkpoint import rank_state, rng
from ucpformat.checkpoint.metadata import (
    FORMAT_MAJOR,
    IN_PROGRESS_KEY,
    MANIFEST_KEY,
    RESERVED_GROUPS,
    RESERVED_ROOT_SUFFIX,
    ROOT_DIGEST,
    ZARR_JSON,
    ArrayMeta,
    GroupMeta,
    check_depth,
    check_root_digest,
    loads,
    parse_array,
    parse_group,
    parse_version,
)
from ucpformat.checkpoint.reader import (
    UNDERSTOOD_FEATURES,
    Checkpoint,
    Tensor,
    metadata_limit,
    read_metadata,
)
from ucpformat.engine.grid import coords_of_key, object_coords, stored_object_coords
from ucpformat.errors import UCPError
from ucpformat.format import names, schemas
from ucpformat.format.jsonvalues import MAX_DOCUMENT_DEPTH, json_equal
from ucpformat.progress import byte_progress
from ucpformat.store import ArchiveStore, ReadOnceStore, Store, read_guarded, unguarded

Level = Literal["error", "warning"]
MAX_SAFE_INTEGER = 2**53 - 1
#: Deep validation of a checkpoint whose manifest is unreadable reads at most this many
#: objects per array.
DEEP_OBJECTS_WITHOUT_MANIFEST = 1 << 20


@dataclass(frozen=True)
class Issue:
    """One problem found in a checkpoint."""

    rule: str | None
    path: str
    message: str
    level: Level = "error"

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "path": self.path, "message": self.message}

    def __str__(self) -> str:
        rule = f"[{self.rule}] " if self.rule else ""
        return f"{self.level}: {rule}{self.path}: {self.message}"


@dataclass
class Report:
    """The outcome of validating one checkpoint."""

    location: str
    issues: list[Issue] = field(default_factory=list)
    deep: bool = False
    checked_objects: int = 0
    #: The issues already reported (a set: a report of 100,000 issues is built in linear time).
    _seen: set[Issue] = field(default_factory=set, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._seen.update(self.issues)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "error"]

    @property
    def warnings(self) -> list[Issue]:
        return [i for i in self.issues if i.level == "warning"]

    @property
    def valid(self) -> bool:
        return not self.errors

    def rules(self) -> set[str]:
        """Requirement ids of every error."""
        return {i.rule for i in self.errors if i.rule}

    def to_json(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "errors": [i.to_json() for i in self.errors],
            "warnings": [i.to_json() for i in self.warnings],
        }

    def add(self, rule: str | None, path: str, message: str, level: Level = "error") -> None:
        issue = Issue(rule, path or "/", message, level)
        if issue not in self._seen:
            self._seen.add(issue)
            self.issues.append(issue)

    def add_error(self, exc: UCPError, path: str) -> None:
        where = exc.tensor or exc.path or path
        if where.startswith(self.location + "/"):  # a file of this checkpoint: its key
            where = where[len(self.location) + 1 :]
        self.add(exc.rule, where, exc.message)


def _node_of_pointer(pointer: str) -> str:
    parts = pointer.strip("/").split("/")
    if len(parts) >= 3 and parts[0] == "consolidated_metadata" and parts[1] == "metadata":
        return parts[2].replace("~1", "/").replace("~0", "~")
    return "/"


def validate(
    path: Any,
    *,
    deep: bool = False,
    progress: bool | Callable[[int], None] = False,
    workers: int = 4,
    max_read_bytes: int | None = None,
    max_metadata_bytes: int | None = None,
) -> Report:
    """Check a checkpoint; never raises for a bad checkpoint (problems go in the report).

    ``max_read_bytes`` bounds what a deep validation decodes at once (one stored object;
    default: the physical memory, as for ``open``); ``max_metadata_bytes`` the largest
    metadata document read (as for ``open``, UCP-1.0-R098). A file the storage refuses to
    read is an error of the report (UCP-1.0-R099), never an exception.
    """
    try:
        store = read_guarded(path)
    except UCPError as exc:
        report = Report(str(path), deep=deep)
        report.add_error(exc, "/")
        return report
    report = Report(store.location, deep=deep)
    try:
        _validate(store, report, deep=deep, progress=progress, workers=workers,
                  max_read_bytes=max_read_bytes,
                  limit=metadata_limit(max_metadata_bytes, max_read_bytes))
    except UCPError as exc:  # a problem that stops validation early
        report.add_error(exc, "/")
    return report


def _validate(
    store: Store,
    report: Report,
    *,
    deep: bool,
    progress: bool | Callable[[int], None],
    workers: int,
    max_read_bytes: int | None = None,
    limit: int,
) -> None:
    raw = read_metadata(store, ZARR_JSON, limit=limit, what="the root zarr.json")
    if raw is None:
        why = (
            "a save was interrupted or is in progress"
            if store.exists(IN_PROGRESS_KEY)
            else "no root zarr.json"
        )
        report.add("UCP-1.0-R051", "/", f"not a committed checkpoint: {why}")
        return
    doc = loads(raw, what=ZARR_JSON)
    check_depth(doc, what=ZARR_JSON)  # before any recursive walk (UCP-1.0-R096)
    for v in root_violations(doc):
        report.add(v.rule, _node_of_pointer(v.pointer), f"{v.message} (at {v.pointer or '/'})")
    if not isinstance(doc, Mapping):
        return
    attrs = doc.get("attributes")
    ucp = attrs.get("ucp") if isinstance(attrs, Mapping) else None
    if not isinstance(ucp, Mapping):
        report.add("UCP-1.0-R002", "/", "the root has no attributes.ucp object")
        return
    try:
        check_root_digest(raw, doc, where=ZARR_JSON)
    except UCPError as exc:
        report.add_error(exc, ZARR_JSON)
    del raw
    try:
        parse_version(ucp.get("version"), where=store.location)
    except UCPError as exc:
        report.add_error(exc, "/")
        return
    must = ucp.get("must_understand", [])
    features = {m for m in must if isinstance(m, str)} if isinstance(must, list) else set()
    unknown = sorted(features - UNDERSTOOD_FEATURES)
    if unknown:  # (a must_understand that is not a list of strings: the schema reports it)
        report.add("UCP-1.0-R061", "/",
                   f"must_understand lists features this reader does not implement: {unknown}")
    if store.exists(IN_PROGRESS_KEY):
        report.add(
            "UCP-1.0-R056", "/",
            f"{IN_PROGRESS_KEY} is still present next to a committed root (a writer stopped "
            "after its commit); the checkpoint is committed",
            "warning",
        )
    arrays, groups = _parse_nodes(doc, report)
    _check_tree(arrays, groups, report)
    _check_values(groups, ucp, report)
    _check_optimizer(arrays, groups, report)
    _check_rng(arrays, groups, report)
    _check_ranks(arrays, groups, report)
    _check_layouts(arrays, groups, report)
    _check_model_group(arrays, groups, report)
    manifest, damaged, listed = _check_manifest(store, ucp, arrays, report, limit=limit)
    node_files: dict[str, bytes] = {}
    _check_node_files(store, doc, report, parsed=arrays.keys() | groups.keys(), damaged=damaged,
                      listed=listed, limit=limit, keep=node_files if deep else None)
    if manifest is not None:
        _check_root_seal(doc, manifest, report)
    cm = doc.get("consolidated_metadata")
    listed_nodes = cm.get("metadata") if isinstance(cm, Mapping) else None
    _check_foreign_files(manifest, arrays,
                         set(listed_nodes) if isinstance(listed_nodes, Mapping) else set(), report)
    if deep:
        # Also when shallow checks failed: every file and every array that parsed is still
        # read, so one run reports all the damage.
        root = parse_group("", doc, root=True)
        ckpt = Checkpoint(store, root, arrays, groups, max_read_bytes=max_read_bytes)
        _deep(ckpt, manifest, damaged, report, progress=progress, workers=workers,
              block=min(HASH_BLOCK, ckpt.max_read_bytes), read=node_files)
        archive = unguarded(store)
        if isinstance(archive, ArchiveStore):
            for name in archive.crc32_mismatches(min(HASH_BLOCK, ckpt.max_read_bytes)):
                report.add("UCP-1.0-R075", name, "the member's bytes do not match the "
                           "CRC-32 its ZIP central directory entry gives")


def root_violations(doc: Any) -> list[schemas.SchemaViolation]:
    """The violations of ``root.schema.json`` by a root document, the same as
    ``schemas.violations("root", doc)`` gives, in time linear in the number of nodes.

    A root the compiled validator accepts has none (see :mod:`ucpformat.format.schemas`).
    Otherwise each node of the consolidated metadata is checked against the array or group
    schema on its own (as the root schema's ``if``/``then``/``else`` does), once per
    distinct document: the states of one parameter, or the experts of one layer, share
    theirs.
    """
    if schemas.fast_accepts("root", doc):  # the whole root in one pass of the compiled check
        return []
    cm = doc.get("consolidated_metadata") if isinstance(doc, Mapping) else None
    nodes = cm.get("metadata") if isinstance(cm, Mapping) else None
    if not isinstance(doc, Mapping) or not isinstance(cm, Mapping) or not isinstance(
            nodes, Mapping) or not nodes:
        return schemas.violations("root", doc)
    # the root with a minimal valid group for every node: checks everything but the nodes
    stand_in = {"zarr_format": 3, "node_type": "group"}
    shell = {**doc, "consolidated_metadata": {**cm, "metadata": dict.fromkeys(nodes, stand_in)}}
    out = schemas.violations("root", shell)
    seen: dict[tuple[str, str], list[schemas.SchemaViolation]] = {}
    for path, node in nodes.items():
        kind = ("array" if isinstance(node, Mapping) and node.get("node_type") == "array"
                else "group")
        key = (kind, json.dumps(node, separators=(",", ":"), ensure_ascii=False))
        found = seen.get(key)
        if found is None:
            found = seen[key] = schemas.violations(kind, node)
        if found:
            prefix = "/consolidated_metadata/metadata/" + str(path).replace(
                "~", "~0").replace("/", "~1")
            out.extend(
                schemas.SchemaViolation(v.rule, prefix + (v.pointer if v.pointer != "/" else ""),
                                        v.message)
                for v in found
            )
    return out


def _parse_nodes(
    doc: Mapping[str, Any], report: Report
) -> tuple[dict[str, ArrayMeta], dict[str, GroupMeta]]:
    arrays: dict[str, ArrayMeta] = {}
    groups: dict[str, GroupMeta] = {}
    cm = doc.get("consolidated_metadata")
    meta = cm.get("metadata") if isinstance(cm, Mapping) else None
    if not isinstance(meta, Mapping):
        report.add("UCP-1.0-R052", "/", "the root holds no inline consolidated metadata")
        return arrays, groups
    for path, node in meta.items():
        try:
            names.check_path(path)
            if isinstance(node, Mapping) and node.get("node_type") == "array":
                arrays[path] = parse_array(path, node)
            else:
                groups[path] = parse_group(path, node)
        except UCPError as exc:
            report.add_error(exc, path)
    return arrays, groups


def _check_tree(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], report: Report
) -> None:
    children: dict[str, list[str]] = {}
    for path in [*arrays, *groups]:
        parent, _, leaf = path.rpartition("/")
        children.setdefault(parent, []).append(leaf)
        if parent and parent not in groups:
            report.add("UCP-1.0-R005", path, f"parent group {parent!r} is not in the metadata")
        if not parent and leaf.lower().endswith(RESERVED_ROOT_SUFFIX):
            report.add("UCP-1.0-R004", path,
                       f"names ending in {RESERVED_ROOT_SUFFIX!r} are reserved at the root")
    for reserved in RESERVED_GROUPS:
        if reserved in arrays:
            report.add("UCP-1.0-R004", reserved, f"{reserved!r} must be a group, not an array")
    for parent, kids in children.items():
        try:
            names.check_case_collisions(kids, parent=parent)
        except UCPError as exc:
            report.add_error(exc, parent or "/")


def _check_node_files(
    store: Store,
    doc: Mapping[str, Any],
    report: Report,
    *,
    parsed: Set[str],
    damaged: set[str],
    listed: Mapping[str, int | None],
    limit: int,
    keep: dict[str, bytes] | None = None,
) -> None:
    """UCP-1.0-R055: every node's own zarr.json equals its entry in the consolidated metadata.

    A node document is read only up to the metadata limit (UCP-1.0-R098), and not at all
    when the manifest check found it missing or of another size than the manifest says
    (``damaged``: reported there, UCP-1.0-R043). ``listed``: the sizes the manifest check's
    listing gave (not asked again); ``parsed``: the nodes whose paths were checked already.
    ``keep`` receives the documents read (key -> bytes), so that a deep validation does
    not read them again.
    """
    cm = doc.get("consolidated_metadata")
    meta = cm.get("metadata") if isinstance(cm, Mapping) else None
    if not isinstance(meta, Mapping):
        return
    for path, node in meta.items():
        key = f"{path}/{ZARR_JSON}"
        if key in damaged:
            continue
        try:
            if path not in parsed:
                names.check_path(path)
            raw = read_metadata(store, key, limit=limit, size=listed.get(key))
        except UCPError as exc:
            report.add_error(exc, path)
            continue
        if raw is None:
            report.add("UCP-1.0-R055", path, "its own zarr.json is missing")
            continue
        if keep is not None:
            keep[key] = raw
        try:
            own = loads(raw, what=key)
            # a value nests no deeper than it has brackets: most documents need no walk
            if raw.count(b"[") + raw.count(b"{") > MAX_DOCUMENT_DEPTH:
                check_depth(own, what=key)
        except UCPError as exc:
            report.add_error(exc, path)
            continue
        if not (_same_text(own, node) or json_equal(own, node)):
            report.add("UCP-1.0-R055", path, "its zarr.json differs from the consolidated metadata")


def _same_text(a: Any, b: Any) -> bool:
    """True if two parsed JSON values have the same canonical text (keys sorted), which
    tells every value's kind and every number exactly: then they are equal (UCP-1.0-R073),
    as :func:`~ucpformat.format.jsonvalues.json_equal` would find member by member, 5 to 10 times
    slower. False says nothing."""
    try:
        return _canonical(a) == _canonical(b)
    except (TypeError, ValueError, RecursionError):
        return False


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False)


def _check_root_seal(doc: Mapping[str, Any], manifest: Mapping[str, Any], report: Report) -> None:
    """UCP-1.0-R045: the root's attributes equal the copy in the (digest-sealed) manifest."""
    attrs = doc.get("attributes")
    if not isinstance(attrs, Mapping) or not isinstance(attrs.get("ucp"), Mapping):
        return  # reported already (UCP-1.0-R002)
    actual = {**attrs, "ucp": {k: v for k, v in attrs["ucp"].items()
                               if k not in ("manifest", ROOT_DIGEST)}}
    sealed = manifest.get("root_attributes")
    if sealed is None:
        report.add("UCP-1.0-R045", ZARR_JSON,
                   "the manifest holds no copy of the root's attributes (root_attributes)")
    elif not json_equal(sealed, actual):
        sealed_ucp = sealed.get("ucp") if isinstance(sealed, Mapping) else None
        sealed_ucp = sealed_ucp if isinstance(sealed_ucp, Mapping) else {}
        changed = sorted(
            k for k in set(actual["ucp"]) | set(sealed_ucp)
            if not json_equal(sealed_ucp.get(k), actual["ucp"].get(k))
        )
        report.add("UCP-1.0-R045", ZARR_JSON,
                   "the root's attributes differ from the copy the manifest seals: the root "
                   f"zarr.json is damaged (attributes.ucp members {changed or ['?']})")


def _walk_ints(value: Any) -> Iterable[int]:
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        yield value
    elif isinstance(value, list):
        for v in value:
            yield from _walk_ints(v)
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _walk_ints(v)


def _check_values(
    groups: Mapping[str, GroupMeta], root_ucp: Mapping[str, Any], report: Report
) -> None:
    sources = [("/", root_ucp.get("values", {})), ("/", root_ucp.get("metadata", {}))]
    sources += [(p, g.values) for p, g in groups.items()]
    for path, values in sources:
        if any(abs(i) > MAX_SAFE_INTEGER for i in _walk_ints(values)):
            report.add(
                "UCP-1.0-R071", path,
                "a JSON value holds an integer beyond 2**53-1, which many JSON parsers round; "
                "store it as an int64/uint64 array",
                "warning",
            )


def _check_optimizer(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], report: Report
) -> None:
    opt = groups.get("optimizer")
    if opt is None:
        return
    values = opt.values
    for v in schemas.violations("optimizer", dict(values)):
        report.add(v.rule, "optimizer", f"values{v.pointer}: {v.message}")
    model_params = {
        names.unescape(p.split("/", 1)[1])
        for p in arrays
        if p.startswith("model/") and p.count("/") == 1
    }
    has_model = "model" in groups
    named: set[str] = set()
    pgs = values.get("param_groups", [])
    for i, pg in enumerate(pgs if isinstance(pgs, list) else []):
        params = pg.get("params", []) if isinstance(pg, Mapping) else []
        for p in params if isinstance(params, list) else []:
            if isinstance(p, str):
                if p in named:
                    report.add("UCP-1.0-R081", "optimizer",
                               f"parameter {p!r} is in more than one param group")
                named.add(p)
                if has_model and p not in model_params:
                    report.add("UCP-1.0-R082", "optimizer",
                               f"param_groups[{i}] names {p!r}, which is not a tensor of model/")
    for path in groups:
        parts = path.split("/")
        if len(parts) == 3 and parts[:2] == ["optimizer", "state"]:
            try:
                pname = names.unescape(parts[2])
            except UCPError:
                continue
            if has_model and pname not in model_params:
                report.add("UCP-1.0-R082", path,
                           f"optimizer state for {pname!r}, which is not a tensor of model/")
            if pgs and pname not in named:
                report.add("UCP-1.0-R082", path,
                           f"optimizer state for {pname!r}, which no param group lists")
    for path in arrays:
        parts = path.split("/")
        if parts[0] == "optimizer" and len(parts) >= 2 and parts[1] == "state" and len(parts) != 4:
            report.add("UCP-1.0-R081", path,
                       "optimizer state arrays live at optimizer/state/<parameter>/<state>")


def _children(arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], parent: str
              ) -> dict[str, str]:
    """The children of node ``parent``: node name (unescaped) -> node path."""
    start = parent + "/"
    return {names.unescape(p[len(start):]): p for p in [*arrays, *groups]
            if p.startswith(start) and "/" not in p[len(start):]}


def _check_ranks(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], report: Report
) -> None:
    """UCP-1.0-R086: ``training/ranks`` (when present): its values, its children named by
    ranks below its world size, and each rank's ``rng`` in the form of UCP-1.0-R085."""
    base = rank_state.GROUP
    if base in arrays:
        report.add(rank_state.RULE, base, "per-rank state is a group, not an array")
        return
    if base not in groups:
        return
    values = groups[base].values
    for v in schemas.violations("ranks", dict(values)):
        report.add(v.rule, base, f"values{v.pointer}: {v.message}")
    children = _children(arrays, groups, base)
    for path, problem in rank_state.problems(values, {n: p in groups
                                                     for n, p in children.items()}):
        report.add(rank_state.RULE, path, problem)
    for path in children.values():
        if path in groups:
            _check_rng(arrays, groups, report, base=f"{path}/{rank_state.RNG}")


def _check_rng(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], report: Report,
    *, base: str = "training/rng",
) -> None:
    """UCP-1.0-R085: the generators of ``base`` (when it is a group), each in its form:
    ``training/rng``, and each rank's ``training/ranks/<r>/rng`` (UCP-1.0-R086)."""
    if base in arrays and base != "training/rng":
        report.add(rank_state.RULE, base, "a rank's generators are a group, not an array")
        return
    if base not in groups:
        return

    def children(parent: str) -> dict[str, str]:
        return _children(arrays, groups, parent)

    def check(path: str, kind: str | None) -> None:
        if path in arrays:
            meta = arrays[path]
            found = rng.problems({}, {"": (meta.dtype.name, len(meta.shape))}, torch_state=True)
            if kind in (rng.PYTHON, rng.NUMPY):
                found = [f"the {kind} generator's state is a group, not an array"]
        elif kind == "torch":
            found = ["a torch generator's state is a 1-D uint8 array, not a group"]
        else:
            inside = children(path)
            found = rng.problems(groups[path].values, {
                name: (arrays[p].dtype.name, len(arrays[p].shape))
                for name, p in inside.items() if p in arrays})
            found += [f"{name}: a group inside a generator's group"
                      for name, p in inside.items() if p in groups]
            if not found and kind is not None and groups[path].values.get("kind") != kind:
                found.append(f"the {kind} generator's group has another kind")
        for problem in found:
            report.add(rng.RULE, path, problem)

    top = children(base)
    for name in (rng.PYTHON, rng.NUMPY, rng.TORCH_CPU):
        if name in top:
            check(top[name], "torch" if name == rng.TORCH_CPU else name)
    for name in (rng.TORCH_CUDA, rng.GENERATORS):
        path = top.get(name)
        if path is None:
            continue
        if path in arrays:
            report.add(rng.RULE, path, "a group of generators, not an array")
            continue
        inside = children(path)
        if name == rng.TORCH_CUDA and sorted(inside) != sorted(str(i) for i in range(len(inside))):
            report.add(rng.RULE, path, "the CUDA devices' states are named 0, 1, ...")
        for child in inside.values():
            check(child, "torch" if name == rng.TORCH_CUDA else None)


def _check_layouts(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], report: Report
) -> None:
    """Layout semantics against each array's shape; aliases; optimizer states
    (UCP-1.0-R100 to UCP-1.0-R109)."""
    from ucpformat.layout.semantics import TensorLayout

    for path, meta in arrays.items():
        doc = meta.ucp.get("layout")
        if doc is None:
            continue
        try:
            TensorLayout.from_json(doc, tensor=path).check(meta.shape, tensor=path)
        except UCPError as exc:
            report.add_error(exc, path)
    for gpath, group in groups.items():
        aliases = group.ucp.get("aliases")
        if not isinstance(aliases, Mapping):
            continue
        for alias, target in aliases.items():
            if not isinstance(alias, str) or not isinstance(target, str):
                continue  # reported by the schema
            try:
                alias_path = f"{gpath}/{names.escape(alias)}"
                target_path = f"{gpath}/{names.escape(target)}"
            except UCPError as exc:
                report.add_error(exc, gpath)
                continue
            if alias_path in arrays:
                report.add("UCP-1.0-R108", alias_path,
                           f"is an alias of {target!r} and must not be stored too")
            if target in aliases:
                report.add("UCP-1.0-R108", gpath,
                           f"alias {alias!r} points to another alias {target!r}")
            elif target_path not in arrays:
                report.add("UCP-1.0-R108", gpath,
                           f"alias {alias!r} points to {target!r}, which is not an array of "
                           "this group")
    for path, meta in arrays.items():
        parts = path.split("/")
        if len(parts) != 4 or parts[:2] != ["optimizer", "state"] or "layout" in meta.ucp:
            continue
        param = arrays.get(f"model/{parts[2]}")
        if param is not None and meta.shape not in ((), param.shape):
            report.add(
                "UCP-1.0-R109", path,
                f"its shape {list(meta.shape)} differs from its parameter's "
                f"{list(param.shape)}, so it cannot follow the parameter's layout; it should "
                "declare its own",
                "warning",
            )


def expected_objects(meta: ArrayMeta) -> list[str]:
    """Keys of every stored object a non-sparse array must have.

    Callers bound ``meta.object_count`` first: a hostile shape can describe more objects
    than fit in memory.
    """
    if math.prod(meta.shape) == 0:
        return []
    return [meta.object_key(c) for c in object_coords(meta)]


def _check_manifest(
    store: Store,
    ucp: Mapping[str, Any],
    arrays: Mapping[str, ArrayMeta],
    report: Report,
    *,
    limit: int,
) -> tuple[dict[str, Any] | None, set[str], dict[str, int | None]]:
    """The manifest checks (UCP-1.0-R042, UCP-1.0-R043, UCP-1.0-R030, UCP-1.0-R031, UCP-1.0-R044):
    the manifest, if it could be
    checked, the listed files found of another size or unreadable (``damaged``), and the
    files of the checkpoint with the sizes its listing gave (empty if not listed).

    The manifest is read only if its size is the one the root gives (UCP-1.0-R043) and within the
    metadata limit (UCP-1.0-R098).
    """
    damaged: set[str] = set()
    ref = ucp.get("manifest")
    if not isinstance(ref, Mapping) or ref.get("path") != MANIFEST_KEY:
        return None, damaged, {}  # reported by the schema
    size = store.size(MANIFEST_KEY)
    if size is None:
        report.add("UCP-1.0-R042", MANIFEST_KEY, "the manifest is missing")
        return None, damaged, {}
    if size != ref.get("nbytes"):
        report.add("UCP-1.0-R043", MANIFEST_KEY,
                   f"the manifest is {size} bytes, the root says {ref.get('nbytes')} (not read)")
        return None, damaged, {}
    raw = read_metadata(store, MANIFEST_KEY, limit=limit, what="the manifest")
    if raw is None:
        report.add("UCP-1.0-R042", MANIFEST_KEY, "the manifest is missing")
        return None, damaged, {}
    if hashlib.sha256(raw).hexdigest() != ref.get("sha256"):
        report.add("UCP-1.0-R043", MANIFEST_KEY,
                   "the manifest's SHA-256 differs from the one in the root")
    try:
        manifest = loads(raw, what=MANIFEST_KEY, rule="UCP-1.0-R042")
        check_depth(manifest, what=MANIFEST_KEY)
    except UCPError as exc:
        report.add_error(exc, MANIFEST_KEY)
        return None, damaged, {}
    del raw
    violations = schemas.violations("manifest", manifest)
    for v in violations:
        report.add(v.rule, MANIFEST_KEY, f"{v.message} (at {v.pointer})")
    if violations:
        return None, damaged, {}
    files: Mapping[str, Any] = manifest["files"]
    for meta in arrays.values():
        listed_node = f"{meta.path}/{ZARR_JSON}"
        if listed_node not in files:
            report.add("UCP-1.0-R042", meta.path, "its zarr.json is not in the manifest")
        if meta.sparse:
            continue
        count = meta.object_count
        if count > len(files):
            report.add(
                "UCP-1.0-R030", meta.path,
                f"needs {count} stored objects, more than the manifest lists in all "
                f"({len(files)}): most of them were never written",
            )
            continue
        for key in expected_objects(meta):
            if key not in files:
                report.add("UCP-1.0-R030", meta.path,
                           f"stored object {key} is not in the manifest (never written)")
    # one listing gives every file and most sizes (a path check per file costs more than
    # the rest of a shallow validation); a size the listing does not give is asked for
    listed = dict(store.list_sizes())
    for key, entry in files.items():
        found = listed.get(key)
        if found is None:
            try:
                found = store.size(key)
            except UCPError as exc:
                report.add_error(exc, key)
                damaged.add(key)
                continue
        if found is None:
            report.add("UCP-1.0-R031", key, "listed in the manifest but missing")
        elif found != entry.get("nbytes"):
            report.add("UCP-1.0-R043", key,
                       f"is {found} bytes, the manifest says {entry.get('nbytes')}")
            damaged.add(key)
    known = set(files) | {ZARR_JSON, MANIFEST_KEY, IN_PROGRESS_KEY}
    for key in listed:
        if key not in known:
            report.add("UCP-1.0-R044", key, "a file that the manifest does not list", "warning")
    return dict(manifest), damaged, listed


def _deep(
    ckpt: Checkpoint,
    manifest: Mapping[str, Any] | None,
    damaged: set[str],
    report: Report,
    *,
    progress: bool | Callable[[int], None],
    workers: int,
    block: int,
    read: Mapping[str, bytes],
) -> None:
    """Read every stored object once: its SHA-256 against the manifest, and the CRC32C of
    every chunk (and shard index) in it; then every other file the manifest lists.

    An object is read whole and its chunks checked from that copy; one larger than the
    checkpoint's ``max_read_bytes`` (what a read may hold) has its digest computed over
    blocks of ``block`` bytes, then its chunks read as any read does (UCP-1.0-R098).
    Files the manifest check found of another size (``damaged``) are not hashed, and the
    node documents the shallow checks read (``read``) are not read again.
    """
    files: Mapping[str, Any] = (manifest or {}).get("files", {})
    total = sum(int(e.get("nbytes", 0)) for e in files.values())
    store = ReadOnceStore(ckpt.store)
    ckpt = Checkpoint(store, ckpt.root, ckpt.arrays, ckpt.groups,
                      max_read_bytes=ckpt.max_read_bytes)

    def digest_of(key: str) -> str | None:
        entry = files.get(key)
        return None if entry is None or key in damaged else entry.get("sha256")

    def check_file(key: str) -> tuple[int, UCPError | Issue | None]:
        entry, digest = files[key], digest_of(key)
        if digest is None:
            return int(entry.get("nbytes", 0)), None
        if key in read:
            data = read[key]
            ok = len(data) == entry.get("nbytes") and hashlib.sha256(data).hexdigest() == digest
            return len(data), None if ok else Issue(
                "UCP-1.0-R043", key, "its SHA-256 differs from the manifest's")
        try:
            return sha256_matches(ckpt.store, key, int(entry["nbytes"]), digest, block)
        except UCPError as exc:
            return 0, exc

    tasks: list[tuple[Tensor, list[int], list[int], str]] = []
    # Never enumerate more objects than the manifest lists (a hostile shape can describe
    # 2**60): a non-sparse array that needs more is already reported (UCP-1.0-R030).
    bound = len(files) if manifest is not None else DEEP_OBJECTS_WITHOUT_MANIFEST
    for meta in ckpt.arrays.values():
        tensor = ckpt[meta.path]
        enumerable = not meta.sparse and meta.object_count <= bound
        coords_list = object_coords(meta) if enumerable else stored_object_coords(meta, files)
        for coords in coords_list:
            lo = [c * e for c, e in zip(coords, meta.object_shape, strict=True)]
            hi = [min(a + e, n) for a, e, n in zip(lo, meta.object_shape, meta.shape, strict=True)]
            tasks.append((tensor, lo, hi, meta.object_key(coords)))
    objects = {task[3] for task in tasks}

    def check_object(
        task: tuple[Tensor, list[int], list[int], str],
    ) -> tuple[int, list[UCPError | Issue]]:
        tensor, lo, hi, key = task
        found: list[UCPError | Issue] = []
        nbytes, digest = 0, digest_of(key)
        listed = int(files[key].get("nbytes", 0)) if key in files else None
        try:
            if listed is not None and listed <= ckpt.max_read_bytes:
                data = store.hold(key)  # a missing object: the read below names it (UCP-1.0-R031)
                nbytes = len(data) if data is not None else 0
                if data is not None and digest is not None and (
                        hashlib.sha256(data).hexdigest() != digest):
                    found.append(Issue("UCP-1.0-R043", key,
                                       "its SHA-256 differs from the manifest's"))
            elif digest is not None:  # too large to hold: hashed in blocks, then read
                nbytes, issue = sha256_matches(ckpt.store, key, int(listed or 0), digest, block)
                if issue is not None:
                    found.append(issue)
            tensor.read_region(lo, hi)
        except UCPError as exc:
            found.append(exc)
        finally:
            store.release(key)
        return nbytes or (listed or 0), found

    def record(problem: UCPError | Issue | None, path: str) -> None:
        if isinstance(problem, Issue):
            report.add(problem.rule, problem.path, problem.message)
        elif problem is not None:
            report.add_error(problem, path)

    with (
        byte_progress(progress, total, "verifying") as advance,
        ThreadPoolExecutor(workers) as pool,
    ):
        for task, (nbytes, problems) in zip(tasks, pool.map(check_object, tasks), strict=True):
            report.checked_objects += 1
            advance(nbytes if task[3] in files else 0)
            for found in problems:
                record(found, task[0].path)
        others = [k for k in files if k not in objects]
        for key, (nbytes, problem) in zip(others, pool.map(check_file, others), strict=True):
            advance(nbytes)
            record(problem, key)


#: Bytes a digest is computed over at a time (deep validation).
HASH_BLOCK = 1 << 20


def sha256_matches(
    store: Store, key: str, nbytes: int, digest: str, block: int
) -> tuple[int, Issue | None]:
    """Bytes read, and an issue if the SHA-256 of the ``nbytes`` bytes of ``key``, read
    ``block`` bytes at a time, is not ``digest`` (UCP-1.0-R043) or the file is shorter
    (UCP-1.0-R031)."""
    h = hashlib.sha256()
    buffer = bytearray(max(1, min(block, nbytes)))
    offset = 0
    while offset < nbytes:
        want = memoryview(buffer)[: min(len(buffer), nbytes - offset)]
        got = store.read_into(key, offset, [want])
        if not got:
            what = "missing" if got is None else f"shorter ({offset} bytes) than listed"
            return offset, Issue("UCP-1.0-R031", key, what)
        h.update(want[:got])
        offset += got
    if h.hexdigest() != digest:
        return offset, Issue("UCP-1.0-R043", key, "its SHA-256 differs from the manifest's")
    return offset, None


def _check_model_group(
    arrays: Mapping[str, ArrayMeta], groups: Mapping[str, GroupMeta], report: Report
) -> None:
    """UCP-1.0-R080: model/ holds its tensors directly."""
    for path in [*arrays, *groups]:
        parts = path.split("/")
        if parts[0] == "model" and len(parts) > 2:
            report.add("UCP-1.0-R080", path,
                       "the tensors of model are its direct children, named by their "
                       "fully-qualified names (model/<escaped name>), not nested groups")
        if parts[0] == "model" and len(parts) == 2 and path in groups:
            report.add("UCP-1.0-R080", path, "model holds arrays only, not groups")


def _check_foreign_files(
    manifest: Mapping[str, Any] | None,
    arrays: Mapping[str, ArrayMeta],
    nodes: set[str],
    report: Report,
) -> None:
    """UCP-1.0-R072: every file of the checkpoint (the manifest lists them, UCP-1.0-R042) is a
    metadata
    document, the manifest, the marker or a stored object of an array.

    Files the manifest does not list are not part of the checkpoint: UCP-1.0-R044 warns about
    them. ``nodes`` are the node paths of the consolidated metadata, parsed or not: the
    files of an array whose metadata is broken are not judged again here.
    """
    listed = set((manifest or {}).get("files", {}))
    for key in sorted(listed):
        if key in (ZARR_JSON, MANIFEST_KEY, IN_PROGRESS_KEY):
            continue
        parent, _, leaf = key.rpartition("/")
        if leaf == ZARR_JSON and parent in nodes:
            continue
        owner = _owner_of(key, nodes)
        if owner is not None:
            meta = arrays.get(owner)
            if meta is None or coords_of_key(meta, key) is not None:
                continue  # a stored object (or an array reported already)
        report.add(
            "UCP-1.0-R072", key,
            "not a file this specification defines (a metadata document, the manifest, the "
            "in-progress marker or a stored object of an array)",
        )


def _owner_of(key: str, nodes: set[str]) -> str | None:
    """The node whose stored objects a key ``<node>/c/...`` would be (the deepest one)."""
    parts = key.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i] == "c" and "/".join(parts[:i]) in nodes:
            return "/".join(parts[:i])
    return None


__all__ = ["FORMAT_MAJOR", "Issue", "Report", "validate"]
