"""What every ``ucp`` command shares: exit codes, locating a checkpoint, output helpers."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Final

from rich.console import Console

from ucpformat.checkpoint.metadata import MANIFEST_KEY, loads
from ucpformat.checkpoint.reader import Checkpoint, open_checkpoint
from ucpformat.engine.compression import Compression
from ucpformat.errors import CheckpointNotFoundError, UCPError
from ucpformat.format import jsonvalues
from ucpformat.store import has_archive_suffix, open_store

#: The command did what was asked and found nothing wrong (valid, identical).
OK: Final = 0
#: The command ran and found a problem: the checkpoint is invalid, or A and B differ.
FOUND: Final = 1
#: The command could not run: bad arguments, a missing or unreadable path, a failed read.
ERROR: Final = 2


class CommandError(UCPError):
    """A command cannot run (not a problem of the checkpoint itself): exit status 2."""


def console() -> Console:
    """A console on the current stdout (so that tests capture it).

    Off a terminal, lines are never wrapped (each issue or tensor stays on one line for
    grep) and never styled: no escape sequences, even where ``FORCE_COLOR`` is set.
    """
    out = sys.stdout
    if out.isatty():
        return Console(file=out, highlight=False)
    return Console(file=out, highlight=False, width=100_000, no_color=True, force_terminal=False)


#: A Python keyword hint in an error message: ``overwrite=True``, ``param_names='model-order'``.
_KEYWORD_HINT = re.compile(r"""\b([a-z][a-z0-9_]*)=(True|'[^']*'|"[^"]*"|\[[^\]]*\])""")


def as_flags(message: str, options: Collection[str]) -> str:
    """``message`` with each keyword hint the library gives (``pass overwrite=True``)
    spelled as the command's flag (``pass --overwrite``), where the command has that flag
    (``options``: its long options) and the message does not name the flag already."""

    def flag(match: re.Match[str]) -> str:
        option = "--" + match[1].replace("_", "-")
        if option not in options or option in message:
            return match[0]
        value = match[2]
        if value == "True":
            return option
        if value.startswith("["):
            return f"{option} NAME,NAME,..."
        return f"{option} {value[1:-1]}"

    return _KEYWORD_HINT.sub(flag, message)


def long_options(parser: Any) -> frozenset[str]:
    """The long options (``--overwrite``) a command's parser accepts, from its usage line."""
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", parser.format_usage()))


def local_path(location: str) -> str:
    """The file-system path of a checkpoint location (``file://`` stripped)."""
    return location[len("file://") :] if location.startswith("file://") else location


def check_location(location: str) -> None:
    """Refuse, as could-not-run, a location that cannot hold a checkpoint at all."""
    if "://" in location and not location.startswith("file://"):
        return  # a store URL: the storage layer says whether it can open it
    path = local_path(location)
    if not os.path.lexists(path):
        raise CheckpointNotFoundError("no such file or directory", rule="UCP-1.0-R051", path=path)
    if os.path.isfile(path):
        return  # a checkpoint in one file: the archive store says whether it is one
    if not os.path.isdir(path):
        raise CommandError("neither a directory nor a file: a checkpoint is a directory, or "
                           "one file (.ucpz)", path=path)
    if not os.access(path, os.R_OK | os.X_OK):
        raise CommandError("permission denied", path=path)
    if not os.listdir(path):
        raise CheckpointNotFoundError("empty directory: no checkpoint here", rule="UCP-1.0-R051",
                                      path=path)


#: The file in which DeepSpeed (and :func:`ucpformat.deepspeed.save` with a tag) names the
#: newest checkpoint of a save directory, ``save_dir/<tag>``.
LATEST = "latest"


def resolve_location(location: str) -> str:
    """The checkpoint a command reads at ``location``: the location itself where it holds a
    root ``zarr.json``; otherwise the tag its DeepSpeed ``latest`` file names (a note on
    stderr says so). Where neither is there, the error names the checkpoints one level
    below (the tags of a DeepSpeed save directory), if any."""
    check_location(location)
    store = open_store(location, durable=False)
    if store.exists("zarr.json"):
        return location
    raw = store.get(LATEST)
    if raw is None:
        tags = _checkpoints_inside(location)
        if tags:
            raise CheckpointNotFoundError(
                "no root zarr.json here and no 'latest' file; checkpoints inside it: "
                + ", ".join(tags[:10]) + (", ..." if len(tags) > 10 else "")
                + f": pass one of them ({location.rstrip('/')}/{tags[-1]})",
                rule="UCP-1.0-R051", path=location)
        return location  # opening it says what is wrong
    tag = raw.decode(errors="replace").strip()
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\x00" in tag:
        raise CheckpointNotFoundError(
            f"no root zarr.json here, and its 'latest' file names {tag!r}, not a directory "
            "name of this directory", rule="UCP-1.0-R051", path=location)
    target = location.rstrip("/") + "/" + tag
    if not open_store(target, durable=False).exists("zarr.json"):
        raise CheckpointNotFoundError(
            f"no root zarr.json here, and the checkpoint its 'latest' file names ({tag!r}) "
            "has none either: not a committed UCP checkpoint", rule="UCP-1.0-R051",
            path=target)
    print(f"ucp: {location} holds no checkpoint; its 'latest' file names {tag!r}: "
          f"reading {target}", file=sys.stderr)
    return target


def _checkpoints_inside(location: str) -> list[str]:
    """Names of the directories directly in a local ``location`` holding a committed
    checkpoint, a root zarr.json beside a manifest (sorted; a group of an uncommitted
    checkpoint has no manifest; none for a URL: listing an object store reads every key),
    and of the checkpoints in one file there (named ``*.ucpz``)."""
    if "://" in location and not location.startswith("file://"):
        return []
    path = local_path(location)
    try:
        with os.scandir(path) as entries:
            return sorted(e.name for e in entries
                          if (e.is_dir(follow_symlinks=False)
                              and os.path.isfile(os.path.join(path, e.name, "zarr.json"))
                              and os.path.isfile(os.path.join(path, e.name, MANIFEST_KEY)))
                          or (e.is_file() and has_archive_suffix(e.name)))
    except OSError:
        return []


def open_location(location: str) -> Checkpoint:
    """Open a checkpoint for a command (following a DeepSpeed ``latest`` file, see
    :func:`resolve_location`): one read of its root metadata."""
    return open_checkpoint(resolve_location(location))


def manifest_files(ckpt: Checkpoint) -> int | None:
    """Number of files the manifest lists, or None when it is missing or unreadable."""
    raw = ckpt.store.get(MANIFEST_KEY)
    if raw is None:
        return None
    try:
        doc = loads(raw, what=MANIFEST_KEY, rule="UCP-1.0-R042")
    except UCPError:
        return None
    files = doc.get("files") if isinstance(doc, Mapping) else None
    return len(files) if isinstance(files, Mapping) else None


def write_json(doc: Any) -> None:
    """Print a JSON document on stdout (strict JSON: no NaN or Infinity).

    Indented on a terminal; one compact line otherwise, because only an un-indented
    ``json.dumps`` runs in C (indenting the document of 10,000 tensors costs 0.2 s).
    """
    pretty = sys.stdout.isatty()
    text = json.dumps(doc, ensure_ascii=False, allow_nan=False, indent=2 if pretty else None)
    sys.stdout.write(text + "\n")


def human_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB`` (IEC units)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def grid_text(shape: Sequence[int]) -> str:
    return "×".join(str(s) for s in shape) if shape else "scalar"


def compression_text(compression: Compression | None) -> str:
    """``zstd:3``, ``gzip:5``, ``blosc:zstd:3:shuffle`` or ``raw``."""
    if compression is None:
        return "raw"
    cfg = compression.configuration
    if compression.name == "zstd":
        return f"zstd:{cfg.get('level')}"
    if compression.name == "gzip":
        return f"gzip:{cfg.get('level')}"
    return f"blosc:{cfg.get('cname')}:{cfg.get('clevel')}:{cfg.get('shuffle')}"


def compression_json(compression: Compression | None) -> dict[str, Any] | None:
    return None if compression is None else compression.to_json()


def value_text(value: Any, limit: int = 100) -> str:
    """A stored JSON value, compact and readable (non-finite floats decoded), cut at ``limit``."""
    try:
        decoded = jsonvalues.decode(value, where="value")
    except UCPError:
        decoded = value
    text = decoded if isinstance(decoded, str) else _compact(decoded)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _compact(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), allow_nan=True,
                      default=str).replace("Infinity", "inf").replace("NaN", "nan")


def logical_path(node_path: str) -> str:
    """A node path shown with its logical (unescaped) names: ``model/fc%2Fw`` -> ``model/fc/w``.

    Only for display: a logical name may itself contain ``/``, so this is not reversible.
    """
    from ucpformat.format import names

    return "/".join(names.split_path(node_path)) if node_path else ""


def training_step(ckpt: Checkpoint) -> Any:
    """The training step, wherever a producer put it (None if nowhere)."""
    candidates: list[Any] = [ckpt.ucp.get("step")]
    training = ckpt.groups.get("training")
    if training is not None:
        candidates.append(training.values.get("step"))
    root_training = ckpt.root.values.get("training")
    if isinstance(root_training, Mapping):
        candidates.append(root_training.get("step"))
    user = ckpt.ucp.get("metadata")
    if isinstance(user, Mapping):
        candidates.append(user.get("step"))
    for value in candidates:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
