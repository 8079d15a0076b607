"""Hugging Face safetensors -> UCP: one file, or a sharded directory (``*.index.json``).

safetensors is JSON plus raw little-endian bytes, so this importer needs neither torch
nor the safetensors package: it parses the header itself (strictly: sizes checked
against the file before anything is allocated) and reads each tensor's byte range.
Every data type keeps its bits: ``BF16`` becomes ``bfloat16``, ``F8_E4M3`` becomes
``float8_e4m3fn`` (PyTorch's, no infinities), ``F8_E5M2`` ``float8_e5m2``.

Tensors go to ``model/<name>``; each file's ``__metadata__`` (keys in the file's
order), the index's ``metadata`` of a sharded directory and a ``config.json`` beside
them are kept in the root metadata (``metadata.source.file_metadata``,
``metadata.source.index_metadata``, ``metadata.huggingface.config``), so that an
export gives them back. Layout semantics
come from a rule file (``rules=``), or are inferred from ``config.json`` for the
model families ucpformat ships rules for (Llama-style and Mixtral-style models).

A Hugging Face ``Trainer`` checkpoint directory (``checkpoint-<step>/``) holds the
training state beside the weights (:data:`TRAINING_STATE`: ``optimizer.pt``,
``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``, ...). This importer reads
safetensors only, and the optimizer's state is keyed by numbers that the weights alone
cannot name, so such a directory is refused, naming the files that would be left
behind: the ``hf-trainer`` importer (:mod:`ucpformat.importers.hf_trainer`) converts the
whole state; ``weights_only=True`` converts the weights alone, and the result's notes
name those files.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat.errors import FormatError, UnsupportedDtypeError
from ucpformat.format import dtypes
from ucpformat.format.dtypes import DataType
from ucpformat.importers._engine import Annotator, Scan, TensorSource, model_attributes, node
from ucpformat.interchange import SAFETENSORS_TO_UCP, UCP_TO_SAFETENSORS
from ucpformat.layout.rules import RuleSet

FORMAT: Final = "safetensors"
#: File names (fnmatch patterns) of a training run's state beside the weights: Hugging
#: Face Trainer's and Accelerate's.
TRAINING_STATE: Final = (
    "trainer_state.json", "training_args.bin", "optimizer.pt", "optimizer.bin",
    "optimizer_*.bin", "scheduler.pt", "scheduler.bin", "scaler.pt", "rng_state.pth",
    "rng_state_*.pth", "random_states_*.pkl",
)
MAX_HEADER_BYTES: Final = 100 * 1000 * 1000  # the safetensors library's own limit

#: safetensors dtype code -> zarr data-type name (the closed list of format 1.0), and back.
TO_UCP: Final = SAFETENSORS_TO_UCP
FROM_UCP: Final = UCP_TO_SAFETENSORS


def _fail(msg: str, path: Path | str, tensor: str | None = None) -> FormatError:
    return FormatError(msg, path=str(path), tensor=tensor)


class Header:
    """The parsed header of one safetensors file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise _fail("not a safetensors file (shorter than 8 bytes)", path)
            (n,) = struct.unpack("<Q", raw)
            if n > MAX_HEADER_BYTES or n + 8 > size:
                raise _fail(f"header length {n} is impossible for a file of {size} bytes", path)
            body = f.read(n)
        try:
            doc = json.loads(body.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise _fail(f"the header is not JSON: {exc}", path) from None
        if not isinstance(doc, dict):
            raise _fail("the header is not a JSON object", path)
        self.data_start = 8 + n
        data_size = size - self.data_start
        meta = doc.pop("__metadata__", None)
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())
        ):
            raise _fail("__metadata__ must map strings to strings", path)
        self.metadata: dict[str, str] = dict(meta or {})
        self.tensors: dict[str, tuple[DataType, tuple[int, ...], int, int]] = {}
        for name, info in doc.items():
            if not isinstance(info, dict):
                raise _fail("tensor entry is not an object", path, name)
            code = info.get("dtype")
            if code not in TO_UCP:
                raise UnsupportedDtypeError(
                    f"safetensors dtype {code!r} has no entry in the closed list of format 1.0",
                    rule="UCP-1.0-R020", tensor=name, path=str(path),
                )
            dt = dtypes.BY_NAME[TO_UCP[code]]
            shape = info.get("shape")
            offsets = info.get("data_offsets")
            if not (isinstance(shape, list) and all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
            )):
                raise _fail(f"bad shape {shape!r}", path, name)
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets
            )):
                raise _fail(f"bad data_offsets {offsets!r}", path, name)
            begin, end = offsets
            if not 0 <= begin <= end <= data_size:
                raise _fail(f"data_offsets {offsets} outside the {data_size} data bytes",
                            path, name)
            if math.prod(shape) * dt.itemsize != end - begin:
                raise _fail(
                    f"shape {shape} of {code} needs {math.prod(shape) * dt.itemsize} bytes, "
                    f"data_offsets give {end - begin}",
                    path, name,
                )
            self.tensors[name] = (dt, tuple(shape), self.data_start + begin,
                                  self.data_start + end)

    def reader(self, name: str) -> Any:
        dt, shape, begin, end = self.tensors[name]
        path = self.path

        def read() -> np.ndarray[Any, Any]:
            out = np.empty(end - begin, dtype=np.uint8)
            with open(path, "rb", buffering=0) as f:
                f.seek(begin)
                view = out.data
                got = 0
                while got < len(view):
                    n = f.readinto(view[got:])
                    if not n:
                        raise _fail("file is shorter than its header says", path, name)
                    got += n
            return out.view(dt.numpy).reshape(shape)

        return read


def _files(path: Path) -> tuple[list[Path], dict[str, str] | None, dict[str, Any] | None]:
    """The safetensors files of a checkpoint and, for a sharded one, its weight map and the
    index's ``metadata``."""
    if path.is_file():
        return [path], None, None
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise _fail(f"several index files: {[p.name for p in indexes]}; give one", path)
    if indexes:
        return _from_index(indexes[0])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise _fail("no .safetensors file here", path)
    return files, None, None


def _from_index(index: Path) -> tuple[list[Path], dict[str, str], dict[str, Any] | None]:
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _fail(f"cannot read the index: {exc}", index) from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise _fail("the index has no weight_map of names to files", index)
    base = index.parent.resolve()
    files = []
    for fname in sorted(set(weight_map.values())):
        f = (index.parent / fname).resolve()
        if f.parent != base or not f.name.endswith(".safetensors"):
            raise _fail(f"weight_map names {fname!r}, not a .safetensors file beside it", index)
        files.append(f)
    meta = doc.get("metadata")
    return files, weight_map, meta if isinstance(meta, dict) else None


def training_state_files(directory: Path) -> list[str]:
    """The names of the files in ``directory`` that hold a training run's state
    (:data:`TRAINING_STATE`), sorted."""
    return sorted(p.name for p in directory.iterdir() if p.is_file() and any(
        fnmatch.fnmatchcase(p.name, pattern) for pattern in TRAINING_STATE))


def detect(path: Path) -> bool:
    if path.is_file():
        if path.suffix == ".safetensors":
            return True
        try:
            with open(path, "rb") as f:
                head = f.read(9)
        except OSError:
            return False
        return len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] < (
            MAX_HEADER_BYTES
        )
    return path.is_dir() and (
        any(path.glob("*.safetensors.index.json")) or any(path.glob("*.safetensors"))
    )


def infer_rules(config: Mapping[str, Any]) -> tuple[RuleSet | None, dict[str, Any]]:
    """A shipped rule file and its parameters for a Hugging Face ``config.json``, if any."""
    family = {
        "llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama",
        "mixtral": "mixtral",
    }.get(str(config.get("model_type", "")))
    if family is None or not isinstance(config.get("vocab_size"), int):
        return None, {}
    params: dict[str, Any] = {
        "vocab_size": config["vocab_size"],
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    if family == "mixtral":
        experts = config.get("num_local_experts")
        if not isinstance(experts, int):
            return None, {}
        params["num_experts"] = experts
    return RuleSet.load(family), params


def scan(
    path: Path,
    *,
    rules: str | os.PathLike[str] | RuleSet | None = None,
    rule_params: Mapping[str, Any] | None = None,
    config: str | os.PathLike[str] | None = None,
    weights_only: bool = False,
) -> Scan:
    """The tensors of a safetensors file or sharded directory, and their layout semantics.

    ``config``: a ``config.json`` to keep (default: the one beside the weights). A
    directory that also holds a training run's state (:func:`training_state_files`) is
    refused unless ``weights_only``, which converts the weights alone and notes the files
    left behind.
    """
    left = training_state_files(path) if path.is_dir() else []
    if left and not weights_only:
        raise FormatError(
            "a training checkpoint (Hugging Face Trainer): converting its safetensors "
            f"weights would leave its training state behind: {', '.join(left)}. This "
            "importer converts weights only (the optimizer's state is keyed by numbers "
            "that only the model can name, and these are pickles). Convert the whole state "
            "as format 'hf-trainer' (detected where trainer_state.json is; its pickles need "
            "allow_pickle=True, --allow-pickle), or pass weights_only=True (--weights-only) "
            "to convert the weights alone",
            path=str(path))
    files, weight_map, index_meta = _files(path)
    out = Scan(FORMAT, str(path))
    if left:
        out.notes.append(f"weights only: the training state was not converted: "
                         f"{', '.join(left)}")
    base = path if path.is_dir() else path.parent
    cfg_path = Path(config) if config is not None else base / "config.json"
    hf_config: dict[str, Any] | None = None
    if cfg_path.is_file():
        try:
            loaded = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise _fail(f"config.json is not JSON: {exc}", cfg_path) from None
        if isinstance(loaded, dict):
            hf_config = loaded
    if rules is None and hf_config is not None:
        inferred, params = infer_rules(hf_config)
        if inferred is not None:
            out.notes.append(f"layout semantics from the shipped rule file {inferred.name!r} "
                             f"(config.json model_type {hf_config.get('model_type')!r})")
            annotator = Annotator(inferred, {**params, **(rule_params or {})})
        else:
            annotator = Annotator()
    else:
        annotator = Annotator.make(rules, rule_params)
    file_meta: dict[str, dict[str, str]] = {}
    seen: dict[str, Path] = {}
    aliases: dict[str, str] = {}
    for f in files:
        header = Header(f)
        if header.metadata:
            file_meta[f.name] = header.metadata
        for name, (dt, shape, _b, _e) in header.tensors.items():
            if name in seen:
                raise _fail(f"tensor {name!r} is in {seen[name].name} and {f.name}", path, name)
            seen[name] = f
            if weight_map is not None and weight_map.get(name) != f.name:
                raise _fail(f"the index places it in {weight_map.get(name)!r}, it is in {f.name}",
                            path, name)
            action, layout, target = annotator.resolve(name, shape)
            if action == "ignore":
                out.notes.append(f"{name}: ignored (rule file)")
                continue
            if action == "alias" and target is not None:
                aliases[name] = target
                out.notes.append(f"{name}: stored once, as an alias of {target} (tied)")
                continue
            role = "parameter" if dt.kind in ("float", "complex") else "buffer"
            out.tensors.append(TensorSource(
                node("model", name), shape, dt, header.reader(name),
                model_attributes(role, layout),
            ))
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(seen))
        if missing:
            raise _fail(f"the index lists tensors no file holds: {missing[:5]}", path)
    if aliases:
        stored = {t.path for t in out.tensors}
        for alias, target in aliases.items():
            if node("model", target) not in stored:
                raise _fail(f"tied to {target!r}, which is not in the checkpoint", path, alias)
        out.groups.setdefault("model", {})["aliases"] = aliases
    source: dict[str, Any] = {"format": FORMAT, "files": [f.name for f in files]}
    if file_meta:
        source["file_metadata"] = file_meta
    if index_meta is not None:
        source["index_metadata"] = index_meta
    out.metadata["source"] = source
    if hf_config is not None:
        out.metadata["huggingface"] = {"config": hf_config}
    return out


__all__ = ["FORMAT", "FROM_UCP", "TO_UCP", "TRAINING_STATE", "Header", "detect", "scan",
           "training_state_files"]
