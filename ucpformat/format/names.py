"""Tensor and group names, and their escaped form as zarr node names.

A logical name (``decoder.layers.3.mlp.fc1.weight``, ``語彙/embed``) is stored as a zarr
node name in which every byte of its UTF-8 encoding outside ``[A-Za-z0-9._-]`` is
percent-encoded (``%2F``), as are the dots of a name made only of dots (``.``, ``..``),
the dot of a name that is ``zarr.json`` up to ASCII case, and the first underscore of a
name that starts with ``__``. Escaping is a bijection, so a node name is valid only when
it is the canonical escape of some name; that rule alone keeps every path inside the
checkpoint. See spec/ucp-1.0.md, section "Names".
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from ucpformat.errors import InvalidNameError, UnsafePathError

MAX_NODE_NAME_BYTES = 255
ZARR_JSON_NAME = "zarr.json"
_SAFE = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_ALL_SAFE_RE = re.compile(r"[A-Za-z0-9._-]+")
_NODE_NAME_RE = re.compile(r"^(?:[A-Za-z0-9._-]|%[0-9A-F]{2})+$")
#: A node name that is its own escape, the common case: unreserved characters only (no
#: ``%``), not only dots, not starting with ``__``, not ``zarr.json`` in any case, at most
#: 255 bytes. Matching it (or a path of such names) is :func:`unescape`'s whole check.
_PLAIN_NAME = (r"(?!\.*(?:/|\Z))(?!__)(?!(?i:zarr\.json)(?:/|\Z))"
               r"[A-Za-z0-9._-]{1,255}(?=/|\Z)")
_PLAIN_NAME_RE = re.compile(_PLAIN_NAME)
_PLAIN_PATH_RE = re.compile(rf"{_PLAIN_NAME}(?:/{_PLAIN_NAME})*")


def check_name(name: str, *, where: str | None = None) -> None:
    """Raise InvalidNameError unless ``name`` is an allowed logical name."""
    if not isinstance(name, str):
        raise InvalidNameError(
            f"names must be strings, got {type(name).__name__} {name!r}",
            rule="UCP-1.0-R011",
            path=where,
        )
    if name == "":
        raise InvalidNameError("names must not be empty", rule="UCP-1.0-R011", path=where)
    if "\x00" in name:
        raise InvalidNameError(
            f"name {name!r} contains a NUL character", rule="UCP-1.0-R011", path=where
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidNameError(
            f"name {name!r} is not valid Unicode (lone surrogate)",
            rule="UCP-1.0-R011",
            path=where,
        ) from None
    escaped = _escape_unchecked(name)
    if len(escaped.encode("ascii")) > MAX_NODE_NAME_BYTES:
        raise InvalidNameError(
            f"name {name[:60]!r}... escapes to {len(escaped)} bytes; "
            f"the limit is {MAX_NODE_NAME_BYTES}",
            rule="UCP-1.0-R012",
            path=where,
        )


def _escape_unchecked(name: str) -> str:
    if name.strip(".") == "":
        # zarr v3 forbids node names made only of periods ("." and ".." among them).
        return "%2E" * len(name)
    if _ALL_SAFE_RE.fullmatch(name) and not name.startswith("__"):
        escaped = name  # fast path, the common case: the loop below would keep every byte
    else:
        raw = name.encode("utf-8")
        out = []
        for i, byte in enumerate(raw):
            if byte in _SAFE and not (i == 0 and byte == ord("_") and raw.startswith(b"__")):
                out.append(chr(byte))
            else:
                out.append(f"%{byte:02X}")
        escaped = "".join(out)
    if escaped.lower() == ZARR_JSON_NAME:
        # A node named zarr.json would collide with its parent's metadata document.
        escaped = escaped[:4] + "%2E" + escaped[5:]
    return escaped


def escape(name: str, *, where: str | None = None) -> str:
    """The zarr node name that stores the logical ``name``."""
    check_name(name, where=where)
    return _escape_unchecked(name)


def unescape(node_name: str, *, where: str | None = None) -> str:
    """The logical name stored as ``node_name``; refuses anything not canonical."""
    if isinstance(node_name, str) and _PLAIN_NAME_RE.fullmatch(node_name):
        return node_name
    if not isinstance(node_name, str) or not _NODE_NAME_RE.match(node_name):
        raise UnsafePathError(
            f"node name {node_name!r} is not a canonical escaped name",
            rule="UCP-1.0-R010",
            path=where,
        )
    if len(node_name) > MAX_NODE_NAME_BYTES:
        raise UnsafePathError(
            f"node name {node_name[:60]!r}... is {len(node_name)} bytes; the limit is "
            f"{MAX_NODE_NAME_BYTES}",
            rule="UCP-1.0-R012",
            path=where,
        )
    name = node_name if "%" not in node_name else _percent_decode(node_name, where)
    if name == "" or "\x00" in name or _escape_unchecked(name) != node_name:
        raise UnsafePathError(
            f"node name {node_name!r} is not the canonical escape of a valid name",
            rule="UCP-1.0-R010",
            path=where,
        )
    return name


def _percent_decode(node_name: str, where: str | None) -> str:
    raw = bytearray()
    i = 0
    while i < len(node_name):
        ch = node_name[i]
        if ch == "%":
            raw.append(int(node_name[i + 1 : i + 3], 16))
            i += 3
        else:
            raw.append(ord(ch))
            i += 1
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise UnsafePathError(
            f"node name {node_name!r} does not decode to UTF-8", rule="UCP-1.0-R010", path=where
        ) from None


def join(*node_names: str) -> str:
    """Join escaped node names into a node path (``model/fc.weight``)."""
    return "/".join(node_names)


def path_of(*names: str) -> str:
    """Escape logical names and join them into a node path."""
    return "/".join(escape(n) for n in names)


def split_path(path: str, *, where: str | None = None) -> list[str]:
    """Split a node path into logical names, refusing anything unsafe.

    The empty path is the root. Every component must be a canonical escaped name, so
    ``..``, absolute paths, empty components and backslashes are all refused.
    """
    if path == "":
        return []
    if not isinstance(path, str):
        raise UnsafePathError(f"path {path!r} is not a string", rule="UCP-1.0-R010", path=where)
    if _PLAIN_PATH_RE.fullmatch(path):
        return path.split("/")
    try:
        return [unescape(part, where=where or path) for part in path.split("/")]
    except UnsafePathError as exc:
        if where is None:
            raise
        # name the whole path, not only the offending component
        raise UnsafePathError(f"path {path!r}: {exc.message}", rule=exc.rule,
                              path=where) from None


def check_path(path: str, *, where: str | None = None) -> None:
    """Raise UnsafePathError unless ``path`` is a valid node path."""
    if where is None and isinstance(path, str):
        _check_path_once(path)
    else:
        split_path(path, where=where)


@functools.lru_cache(maxsize=1 << 16)
def _check_path_once(path: str) -> None:
    """:func:`split_path` of a path, remembered once valid (a failure is not cached): every
    save of a training run names the same tensors, and each of its ranks checks the
    path of every fragment it describes."""
    split_path(path)


def check_case_collisions(node_names: Iterable[str], *, parent: str) -> None:
    """Refuse sibling node names that are equal when ASCII case is ignored.

    Such names collide on case-insensitive file systems (macOS, Windows).
    """
    seen: dict[str, str] = {}
    for node in node_names:
        folded = node.lower()
        if folded in seen and seen[folded] != node:
            raise InvalidNameError(
                f"names {seen[folded]!r} and {node!r} differ only in case; they would "
                "collide on case-insensitive file systems",
                rule="UCP-1.0-R013",
                path=parent or "/",
            )
        seen[folded] = node
