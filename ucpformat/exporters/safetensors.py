"""UCP -> Hugging Face safetensors: one file, or shards with ``model.safetensors.index.json``.

The file is laid out as the safetensors library lays it out (tensors ordered by data
type, widest first, then by name; compact JSON header padded with spaces to 8 bytes),
and each file's ``__metadata__`` comes back as the import kept it: the keys in the
file's order, or no ``__metadata__`` where the file had none (see :func:`file_metadata`).
So one file the safetensors library wrote, imported and exported to one file, comes back
byte for byte. Bits are kept: ``bfloat16`` -> ``BF16``, ``float8_e4m3fn`` -> ``F8_E4M3``.
The header is written first (every offset is known from the metadata), then each tensor
as it is read.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat.checkpoint.reader import Checkpoint, Tensor
from ucpformat.errors import InvalidValueError, UnsupportedDtypeError
from ucpformat.exporters import ExportResult
from ucpformat.exporters._common import (
    atomic_dir,
    atomic_file,
    model_tensors,
    read_stream,
)
from ucpformat.interchange import UCP_TO_SAFETENSORS, parse_size

FORMAT: Final = "safetensors"
#: The safetensors library's order of data types (it writes the widest first).
DTYPE_ORDER: Final = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "C64",
    "F64", "I64", "U64",
)
_RANK = {code: i for i, code in enumerate(DTYPE_ORDER)}


def _code(t: Tensor, name: str) -> str:
    code = UCP_TO_SAFETENSORS.get(t.meta.dtype.name)
    if code is None:
        raise UnsupportedDtypeError(f"safetensors has no data type for {t.meta.dtype.name}",
                                    tensor=name)
    return code


def canonical_order(items: Sequence[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    return sorted(items, key=lambda it: (-_RANK[_code(it[1], it[0])], it[0].encode("utf-8")))


def header_bytes(items: Sequence[tuple[str, Tensor]], metadata: Mapping[str, str] | None) -> bytes:
    """The header of a file of ``items`` (in that order); ``metadata`` in its own order
    (None: no ``__metadata__``; the safetensors library writes its keys in any order)."""
    doc: dict[str, Any] = {}
    if metadata is not None:
        doc["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in items:
        doc[name] = {"dtype": _code(t, name), "shape": list(t.shape),
                     "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _write_file(
    path: Path,
    items: Sequence[tuple[str, Tensor]],
    metadata: Mapping[str, str] | None,
    *,
    workers: int | None,
    memory_limit: int | None,
    progress: bool | Callable[[int], None],
) -> int:
    ordered = canonical_order(items)
    with open(path, "wb") as f:
        f.write(header_bytes(ordered, metadata))
        for _name, data in read_stream(ordered, workers=workers, memory_limit=memory_limit,
                                       progress=progress, description=f"writing {path.name}"):
            arr = np.ascontiguousarray(data)
            f.write(arr.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    return sum(t.nbytes for _, t in items)


#: The ``__metadata__`` of a file exported from a checkpoint that was not imported from
#: safetensors (what Hugging Face's ``save_pretrained`` writes).
DEFAULT_METADATA: Final = {"format": "pt"}


def file_metadata(ckpt: Checkpoint, file_name: str) -> tuple[dict[str, str] | None, str | None]:
    """The ``__metadata__`` of exported file ``file_name`` (None: none), and a note where
    it is not the source's own.

    A checkpoint imported from safetensors recorded each source file's metadata
    (``metadata.source.file_metadata``; a file not listed there had none). The exported
    file gets the metadata of the source file of its name; else the metadata all source
    files shared (none where none had any); else, where the files differed,
    :data:`DEFAULT_METADATA` with a note. Other checkpoints: :data:`DEFAULT_METADATA`.
    """
    source = ckpt.metadata.get("source", {})
    if not isinstance(source, Mapping) or source.get("format") != FORMAT:
        return dict(DEFAULT_METADATA), None
    per_file = source.get("file_metadata", {})
    per_file = per_file if isinstance(per_file, Mapping) else {}
    files = source.get("files")
    files = [f for f in files if isinstance(f, str)] if isinstance(files, list) else []
    files = files or list(per_file)

    def of(name: str) -> dict[str, str] | None:
        meta = per_file.get(name)
        return dict(meta) if isinstance(meta, Mapping) else None

    if file_name in files:
        return of(file_name), None
    distinct = {json.dumps(of(f), sort_keys=True) for f in files}
    if len(distinct) <= 1:
        return (of(files[0]) if files else None), None
    return dict(DEFAULT_METADATA), (
        f"{file_name}: the source files' __metadata__ differ and none is named "
        f"{file_name}: wrote {json.dumps(DEFAULT_METADATA)} (pass metadata= to choose)")


def index_metadata(ckpt: Checkpoint, total: int) -> dict[str, Any]:
    """The ``metadata`` of an exported ``model.safetensors.index.json``: the source index's
    (as imported; Hugging Face keeps the user's metadata there), ``total_size`` updated."""
    source = ckpt.metadata.get("source", {})
    kept = source.get("index_metadata") if isinstance(source, Mapping) else None
    if isinstance(source, Mapping) and source.get("format") == FORMAT and isinstance(
            kept, Mapping):
        return {**kept, "total_size": total}
    return {"total_size": total}


def shard(items: Sequence[tuple[str, Tensor]], max_bytes: int) -> list[list[tuple[str, Tensor]]]:
    """Greedy split in name order, as Hugging Face does: a new shard when the next
    tensor would overflow this one (a tensor larger than the limit gets its own)."""
    shards: list[list[tuple[str, Tensor]]] = [[]]
    size = 0
    for item in sorted(items, key=lambda it: it[0]):
        n = item[1].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards


def export(
    ckpt: Checkpoint,
    destination: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    workers: int | None = None,
    memory_limit: int | None = None,
    progress: bool | Callable[[int], None] = False,
    max_shard_size: int | str | None = None,
    include_aliases: bool = False,
    metadata: Mapping[str, str] | None = None,
    write_config: bool = True,
) -> ExportResult:
    """Write the model tensors of ``ckpt`` as safetensors.

    A destination ending in ``.safetensors`` is one file; any other is a directory with
    ``model.safetensors``, or shards of at most ``max_shard_size`` (``"5GB"``) and
    ``model.safetensors.index.json``, plus ``config.json`` if the checkpoint kept one
    (``write_config``). Tied tensors are left out, as Hugging Face does, unless
    ``include_aliases``. ``metadata`` replaces every file's ``__metadata__`` (else
    :func:`file_metadata`: the source's own, as the import kept it).
    """
    dest = Path(destination)
    items = model_tensors(ckpt, include_aliases=include_aliases)
    if metadata is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidValueError("safetensors metadata maps strings to strings")
    kw: dict[str, Any] = {"workers": workers, "memory_limit": memory_limit,
                          "progress": progress}
    notes: list[str] = []

    def meta_of(name: str) -> Mapping[str, str] | None:
        if metadata is not None:
            return metadata
        meta, note = file_metadata(ckpt, name)
        if note:
            notes.append(note)
        return meta

    total = sum(t.nbytes for _, t in items)
    if dest.suffix == ".safetensors":
        if max_shard_size is not None and total > parse_size(max_shard_size):
            raise InvalidValueError(
                f"{total} bytes do not fit one file of max_shard_size {max_shard_size}; "
                "export to a directory to shard", path=str(dest),
            )
        with atomic_file(dest, overwrite=overwrite) as tmp:
            _write_file(tmp, items, meta_of(dest.name), **kw)
        return ExportResult(ckpt.location, str(dest), FORMAT, len(items), total, (dest.name,),
                            notes=tuple(notes))
    shards = [items] if max_shard_size is None else shard(items, parse_size(max_shard_size))
    files: list[str] = []
    with atomic_dir(dest, overwrite=overwrite) as tmp:
        if len(shards) == 1:
            name = "model.safetensors"
            _write_file(tmp / name, shards[0], meta_of(name), **kw)
            files.append(name)
        else:
            weight_map: dict[str, str] = {}
            for i, part in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_file(tmp / name, part, meta_of(name), **kw)
                files.append(name)
                weight_map.update({n: name for n, _ in part})
            index = {"metadata": index_metadata(ckpt, total),
                     "weight_map": dict(sorted(weight_map.items()))}
            (tmp / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2) + "\n", encoding="utf-8")
            files.append("model.safetensors.index.json")
        hf = ckpt.metadata.get("huggingface", {})
        if write_config and isinstance(hf, Mapping) and isinstance(hf.get("config"), Mapping):
            (tmp / "config.json").write_text(json.dumps(hf["config"], indent=2) + "\n",
                                             encoding="utf-8")
            files.append("config.json")
    return ExportResult(ckpt.location, str(dest), FORMAT, len(items), total, tuple(files),
                        notes=tuple(notes))


__all__ = ["DEFAULT_METADATA", "FORMAT", "export", "file_metadata", "header_bytes",
           "index_metadata", "shard"]
