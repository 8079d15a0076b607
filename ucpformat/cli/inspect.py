"""``ucp inspect``: the tree of a checkpoint, from its root metadata alone.

Reads the root ``zarr.json`` (consolidated metadata) and the manifest (for the file
count); never a tensor's data.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from rich.text import Text
from rich.tree import Tree

from ucpformat.checkpoint.metadata import ArrayMeta
from ucpformat.checkpoint.reader import Checkpoint
from ucpformat.cli.common import (
    FOUND,
    OK,
    compression_json,
    compression_text,
    console,
    grid_text,
    human_bytes,
    manifest_files,
    open_location,
    shape_text,
    training_step,
    value_text,
    write_json,
)
from ucpformat.format import names

#: Without --all, a group shows this many children and a count of the rest.
MAX_CHILDREN = 12


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "inspect",
        parents=[common],
        help="show groups, tensors and metadata (reads metadata only)",
        description="Show the groups, tensors (shape, dtype, size, chunking, compression, "
        "attributes) and metadata of a checkpoint. Reads the root zarr.json and the manifest "
        "only, never tensor data.",
    )
    p.add_argument("path", help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print a machine-readable document")
    p.add_argument("--all", action="store_true",
                   help=f"list every child of every group (default: the first {MAX_CHILDREN})")
    p.set_defaults(run=run, invalid_status=FOUND)


def run(args: argparse.Namespace) -> int:
    ckpt = open_location(args.path)
    files = manifest_files(ckpt)
    if args.json:
        write_json(document(ckpt, files))
    else:
        render(ckpt, files, show_all=args.all)
    return OK


# -- the JSON document ----------------------------------------------------------------


def tensor_json(meta: ArrayMeta, parents: dict[str, list[str]] | None = None) -> dict[str, Any]:
    """One tensor of ``inspect --json``; ``parents`` caches the unescaped group paths."""
    parent, _, leaf = meta.path.rpartition("/")
    cache = {} if parents is None else parents
    if parent not in cache:
        cache[parent] = names.split_path(parent)
    parts = [*cache[parent], names.unescape(leaf)]
    return {
        "path": meta.path,
        "name": parts[-1],
        "names": parts,
        "shape": list(meta.shape),
        "dtype": meta.dtype.name,
        "nbytes": meta.nbytes,
        "chunk_shape": list(meta.chunk_shape),
        "shard_shape": None if meta.shard_shape is None else list(meta.shard_shape),
        "compression": compression_json(meta.compression),
        "attributes": dict(meta.ucp),
    }


def document(ckpt: Checkpoint, files: int | None) -> dict[str, Any]:
    """What ``inspect --json`` prints. Values are as stored (non-finite floats tagged)."""
    ucp = ckpt.ucp
    parents: dict[str, list[str]] = {}
    groups: dict[str, Any] = {"": dict(ckpt.root.values)}
    for path in sorted(ckpt.groups):
        groups[path] = dict(ckpt.groups[path].values)
    return {
        "location": ckpt.location,
        "version": ckpt.version,
        "producer": ucp.get("producer"),
        "created": ucp.get("created"),
        "step": training_step(ckpt),
        "metadata": dict(ucp.get("metadata", {})),
        "groups": groups,
        "tensors": [tensor_json(ckpt.arrays[p], parents) for p in sorted(ckpt.arrays)],
        "aliases": [
            {"group": group, "name": alias, "target": target,
             "target_path": f"{group}/{names.escape(target)}"}
            for group, alias, target in aliases(ckpt)
        ],
        "nbytes": sum(m.nbytes for m in ckpt.arrays.values()),
        "files": files,
    }


def aliases(ckpt: Checkpoint) -> list[tuple[str, str, str]]:
    """(group path, alias, stored name) of every tied tensor: a logical name that a
    group's ``attributes.ucp.aliases`` maps onto a tensor stored once (spec UCP-1.0-R108)."""
    out: list[tuple[str, str, str]] = []
    for path in sorted(ckpt.groups):
        table = ckpt.groups[path].ucp.get("aliases")
        if isinstance(table, Mapping):
            out.extend((path, str(alias), str(target)) for alias, target in table.items())
    return out


# -- the tree --------------------------------------------------------------------------


def layout_text(layout: Any) -> str:
    """``attributes.ucp.layout`` on one line: ``layout[tp=dim0 parts=q:4096,k:1024 layer=3]``."""
    if not isinstance(layout, Mapping):
        return f"layout={value_text(layout, 80)}"
    items = []
    for key, value in layout.items():
        if isinstance(value, Mapping) and "dim" in value:
            rest = "".join(f",{k}={value_text(v, 30)}" for k, v in value.items() if k != "dim")
            items.append(f"{key}=dim{value_text(value['dim'], 10)}{rest}")
        elif key == "parts" and isinstance(value, list) and all(
            isinstance(p, Mapping) and "name" in p and "size" in p for p in value
        ):
            items.append("parts=" + ",".join(f"{p['name']}:{p['size']}" for p in value))
        else:
            items.append(f"{key}={value_text(value, 60)}")
    return "layout[" + " ".join(items) + "]"


def _attributes_text(ucp: Mapping[str, Any]) -> str:
    parts = []
    for key in sorted(ucp, key=lambda k: (k != "role", k != "layout", k)):
        value = ucp[key]
        if key == "role":
            parts.append(f"role={value}")
        elif key == "layout":
            parts.append(layout_text(value))
        elif value is True:
            parts.append(key)
        else:
            parts.append(f"{key}={value_text(value, 80)}")
    return " ".join(parts)


def tensor_label(meta: ArrayMeta, name: str) -> Text:
    if meta.shard_shape is None:
        chunking = f"chunk {grid_text(meta.chunk_shape)}"
    else:
        chunking = f"chunk {grid_text(meta.chunk_shape)} / shard {grid_text(meta.shard_shape)}"
    label = Text.assemble(
        (name, "bold"),
        "  ",
        (meta.dtype.name, "cyan"),
        " ",
        shape_text(meta.shape),
        "  ",
        (human_bytes(meta.nbytes), "green"),
        "  ",
        (chunking, "dim"),
        "  ",
        (compression_text(meta.compression), "dim"),
    )
    attrs = _attributes_text(meta.ucp)
    if attrs:
        label.append("  ")
        label.append(attrs, "magenta")
    return label


def _param_groups_text(value: Any) -> str:
    if not isinstance(value, list):
        return value_text(value)
    parts = [f"{len(value)} group{'s' if len(value) != 1 else ''}"]
    for i, pg in enumerate(value[:4]):
        if not isinstance(pg, Mapping):
            continue
        params = pg.get("params")
        hyper = " ".join(
            f"{k}={value_text(v, 40)}" for k, v in pg.items() if k != "params"
        )
        count = len(params) if isinstance(params, list) else "?"
        parts.append(f"[{i}] {count} params {hyper}".rstrip())
    if len(value) > 4:
        parts.append(f"… {len(value) - 4} more")
    return "; ".join(parts)


def _add_values(node: Tree, values: Mapping[str, Any]) -> None:
    for key in values:
        value = values[key]
        text = _param_groups_text(value) if key == "param_groups" else value_text(value)
        node.add(Text.assemble((key, "yellow"), " = ", text))


def _group_label(name: str, count: int, nbytes: int) -> Text:
    return Text.assemble(
        (f"{name}/", "bold blue"),
        "  ",
        (f"{count} tensor{'s' if count != 1 else ''}, {human_bytes(nbytes)}", "dim"),
    )


def build_tree(ckpt: Checkpoint, *, show_all: bool = False) -> Tree:
    """A rich Tree of groups (with their values) and tensors, by logical name."""
    tree = Tree(Text(f"{ckpt.location}", "bold"), guide_style="dim")
    _add_values(tree, ckpt.root.values)
    # per group: the tensors below it (recursively), for the group labels
    totals: dict[str, list[int]] = {p: [0, 0] for p in ckpt.groups}
    for path, meta in ckpt.arrays.items():
        ancestor = path.rpartition("/")[0]
        while ancestor:
            if ancestor in totals:
                totals[ancestor][0] += 1
                totals[ancestor][1] += meta.nbytes
            ancestor = ancestor.rpartition("/")[0]
    nodes: dict[str, Tree | None] = {"": tree}
    shown: dict[str, int] = {}
    hidden: dict[str, int] = {}
    for path in sorted([*ckpt.groups, *ckpt.arrays]):
        parent_path, _, node_name = path.rpartition("/")
        parent = nodes.get(parent_path)
        if parent is None:  # inside a group that is not shown
            nodes[path] = None
            continue
        if not show_all and shown.get(parent_path, 0) >= MAX_CHILDREN:
            hidden[parent_path] = hidden.get(parent_path, 0) + 1
            nodes[path] = None
            continue
        shown[parent_path] = shown.get(parent_path, 0) + 1
        name = names.unescape(node_name)
        if path in ckpt.groups:
            count, nbytes = totals[path]
            group_node = parent.add(_group_label(name, count, nbytes))
            _add_values(group_node, ckpt.groups[path].values)
            nodes[path] = group_node
        else:
            parent.add(tensor_label(ckpt.arrays[path], name))
            nodes[path] = None
    for group, alias, target in aliases(ckpt):
        node = nodes.get(group)
        if node is not None:
            node.add(Text.assemble((alias, "bold"), "  ", ("-> " + target, "magenta"),
                                   ("  (tied: stored once, under that name)", "dim")))
    for parent_path, count in hidden.items():
        more = nodes[parent_path]
        assert more is not None
        more.add(Text(f"… {count} more (ucp inspect --all lists them)", "dim italic"))
    return tree


def header(ckpt: Checkpoint) -> Text:
    ucp = ckpt.ucp
    producer = ucp.get("producer")
    parts = [f"UCP {ckpt.version}"]
    if isinstance(producer, Mapping):
        who = " ".join(str(producer[k]) for k in ("name", "version") if k in producer)
        if who:
            parts.append(f"written by {who}")
    if "created" in ucp:
        parts.append(f"created {ucp['created']}")
    step = training_step(ckpt)
    if step is not None:
        parts.append(f"step {step}")
    text = Text(" · ".join(parts), "bold")
    metadata = ucp.get("metadata")
    if isinstance(metadata, Mapping) and metadata:
        text.append("\nmetadata: ", "yellow")
        text.append(value_text(dict(metadata), 400))
    return text


def summary(ckpt: Checkpoint, files: int | None) -> str:
    n = len(ckpt.arrays)
    nbytes = sum(m.nbytes for m in ckpt.arrays.values())
    file_text = "manifest missing or unreadable" if files is None else f"{files:,} files"
    plural = "s" if n != 1 else ""
    return f"{n:,} tensor{plural}, {human_bytes(nbytes)} ({nbytes:,} bytes), {file_text}"


def render(ckpt: Checkpoint, files: int | None, *, show_all: bool = False) -> None:
    out = console()
    out.print(header(ckpt))
    out.print(build_tree(ckpt, show_all=show_all))
    out.print(Text(summary(ckpt, files), "bold"))
