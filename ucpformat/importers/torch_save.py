"""``torch.save`` files -> UCP: state dicts, or training checkpoints with an optimizer.

Files are loaded with ``torch.load(weights_only=True, mmap=True)``: only tensors,
containers and primitive values are ever unpickled, and tensor data stays in the file
until the engine copies it out, tensor by tensor. A Hugging Face directory of
``pytorch_model*.bin`` shards with its ``*.bin.index.json`` is one checkpoint.

What goes where:

* a flat mapping of names to tensors (``model.state_dict()``) -> ``model/<name>``;
* a mapping holding a state dict under ``model`` / ``state_dict`` / ``module`` (or
  ``model_key=``), and optionally a ``torch.optim`` state dict under ``optimizer`` /
  ``optim`` (or ``optimizer_key=``): the model as above, the optimizer's per-parameter
  state to ``optimizer/state/<param>/<state>`` and its ``param_groups`` to the
  ``optimizer`` group's values, every other entry to ``training/`` (tensors as arrays,
  the rest as JSON values; what is neither is left out, with a note).

torch numbers optimizer parameters; their names come from ``param_groups[i]
["param_names"]`` (optimizers built from ``named_parameters()``), from
``param_names=[...]`` (the names in the optimizer's order), or, with
``param_names="model-order"``, from the model's tensors in order, checked shape by
shape against the optimizer state (right for models without buffers between
parameters; refused when a shape disagrees).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from ucpformat.errors import FormatError, InvalidValueError
from ucpformat.format import jsonvalues
from ucpformat.importers._engine import Annotator, Scan, TensorSource, model_attributes, node
from ucpformat.importers._torch import (
    is_tensor,
    load_restricted,
    plain,
    tensor_reader,
)
from ucpformat.interchange import data_type_of
from ucpformat.layout.rules import RuleSet

FORMAT: Final = "torch"
MODEL_KEYS: Final = ("model", "state_dict", "module", "model_state_dict", "model_state")
OPTIMIZER_KEYS: Final = ("optimizer", "optim", "optimizer_state_dict", "optimizer_state")
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def is_torch_file(path: Path) -> bool:
    """A ``torch.save`` zip archive (``*/data.pkl``) or a legacy torch pickle."""
    if not path.is_file():
        return False
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                return any(n.endswith("/data.pkl") or n == "data.pkl" for n in z.namelist()[:4])
        with open(path, "rb") as f:
            return f.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC
    except (OSError, zipfile.BadZipFile):
        return False


def detect(path: Path) -> bool:
    if path.is_dir():
        return any(path.glob("*.bin.index.json"))
    return is_torch_file(path)


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    indexes = sorted(path.glob("*.bin.index.json"))
    if len(indexes) != 1:
        raise FormatError("a directory needs exactly one *.bin.index.json", path=str(path))
    doc = json.loads(indexes[0].read_text(encoding="utf-8"))
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        raise FormatError("the index has no weight_map", path=str(indexes[0]))
    base = path.resolve()
    files = []
    for fname in sorted(set(map(str, wm.values()))):
        f = (path / fname).resolve()
        if f.parent != base:
            raise FormatError(f"weight_map names {fname!r}, outside the directory",
                              path=str(indexes[0]))
        files.append(f)
    return files


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(
        isinstance(k, str) and is_tensor(v) for k, v in value.items()
    )


def _is_optimizer(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and isinstance(value.get("state"), Mapping)
        and isinstance(value.get("param_groups"), list)
    )


def _pick(obj: Mapping[str, Any], given: str | None, candidates: Sequence[str],
          test: Any, what: str) -> str | None:
    if given is not None:
        if given not in obj:
            raise InvalidValueError(f"no {what} under key {given!r}; keys: {sorted(obj)[:10]}")
        if not test(obj[given]):
            raise InvalidValueError(f"the value under {given!r} is not a {what}")
        return given
    for key in candidates:
        if key in obj and test(obj[key]):
            return key
    return None


def optimizer_names(
    opt: Mapping[str, Any],
    model_shapes: Mapping[str, tuple[int, ...]],
    param_names: Sequence[str] | str | None,
) -> dict[int, str]:
    """Parameter index -> name, for a ``torch.optim`` state dict."""
    groups = opt["param_groups"]
    ids: list[int] = [int(i) for g in groups for i in g.get("params", [])]
    if all("param_names" in g for g in groups):
        names = [str(n) for g in groups for n in g["param_names"]]
        if len(names) == len(ids):
            return dict(zip(ids, names, strict=True))
    if param_names is None:
        raise InvalidValueError(
            "the optimizer state names its parameters by number only; give the parameter "
            "names in the optimizer's order (param_names=[...]) or take them from the model's "
            "tensors in order (param_names='model-order')"
        )
    if param_names == "model-order":
        candidates = list(model_shapes)
        if len(candidates) < len(ids):
            raise InvalidValueError(f"{len(ids)} optimizer parameters, {len(candidates)} tensors")
        names = candidates[: len(ids)]
        state = opt["state"]
        for i, name in zip(ids, names, strict=True):
            for sname, value in dict(state.get(i, {})).items():
                shape = tuple(value.shape) if is_tensor(value) else ()
                if shape and shape != model_shapes[name]:
                    raise InvalidValueError(
                        f"param_names='model-order' gives parameter {i} the name {name!r} of "
                        f"shape {list(model_shapes[name])}, but its state {sname!r} has shape "
                        f"{list(value.shape)}: give the names explicitly (param_names=[...])"
                    )
    else:
        names = [str(n) for n in param_names]
        if len(names) != len(ids):
            raise InvalidValueError(f"param_names has {len(names)} names, the optimizer "
                                    f"{len(ids)} parameters")
    return dict(zip(ids, names, strict=True))


def scan(
    path: Path,
    *,
    model_key: str | None = None,
    optimizer_key: str | None = None,
    param_names: Sequence[str] | str | None = None,
    rules: str | os.PathLike[str] | RuleSet | None = None,
    rule_params: Mapping[str, Any] | None = None,
) -> Scan:
    """The tensors and values of a ``torch.save`` file (or a directory of ``.bin`` shards)."""
    out = Scan(FORMAT, str(path))
    annotator = Annotator.make(rules, rule_params)
    objs = [load_restricted(f, mmap=True, stand_ins={}) for f in _files(path)]
    if len(objs) > 1:
        merged: dict[str, Any] = {}
        for obj in objs:
            if not _is_state_dict(obj):
                raise FormatError("a sharded torch checkpoint must hold state dicts",
                                  path=str(path))
            dup = set(merged) & set(obj)
            if dup:
                raise FormatError(f"tensors in several shards: {sorted(dup)[:5]}", path=str(path))
            merged.update(obj)
        top: Any = merged
    else:
        top = objs[0]
    if is_tensor(top):
        top = {"tensor": top}
    if not isinstance(top, Mapping):
        raise FormatError(f"a torch.save file holding a {type(top).__name__}, not a mapping",
                          path=str(path))
    if _is_state_dict(top):
        model, mkey, optimizer, okey, rest = top, None, None, None, {}
    else:
        mkey = _pick(top, model_key, MODEL_KEYS, _is_state_dict, "state dict")
        okey = _pick(top, optimizer_key, OPTIMIZER_KEYS, _is_optimizer, "torch.optim state dict")
        if mkey is None and okey is None:
            raise FormatError(
                "neither a state dict nor a training checkpoint with one under "
                f"{list(MODEL_KEYS)} (give model_key=)", path=str(path),
            )
        model = top[mkey] if mkey else {}
        optimizer = top[okey] if okey else None
        rest = {k: v for k, v in top.items() if k not in (mkey, okey)}
    out.metadata["source"] = {"format": FORMAT, "model_key": mkey, "optimizer_key": okey}

    aliases: dict[str, str] = {}
    for name, t in model.items():
        action, layout, target = annotator.resolve(name, tuple(t.shape))
        if action == "ignore":
            out.notes.append(f"{name}: ignored (rule file)")
            continue
        if action == "alias" and target is not None:
            aliases[name] = target
            continue
        dt = data_type_of(t.dtype, tensor=name)
        role = "parameter" if dt.kind in ("float", "complex") else "buffer"
        out.tensors.append(TensorSource(node("model", name), tuple(t.shape), dt,
                                        tensor_reader(t, name, mapped=True),
                                        model_attributes(role, layout)))
    if aliases:
        out.groups.setdefault("model", {})["aliases"] = aliases

    if optimizer is not None:
        shapes = {n: tuple(t.shape) for n, t in model.items()}
        by_id = optimizer_names(optimizer, shapes, param_names)
        for i, st in optimizer["state"].items():
            pname = by_id.get(int(i))
            if pname is None:
                raise FormatError(f"optimizer state for parameter {i}, which no group lists",
                                  path=str(path))
            if model and pname not in shapes and pname not in aliases:
                raise FormatError(f"optimizer parameter {pname!r} is not a model tensor",
                                  path=str(path))
            values: dict[str, Any] = {}
            for sname, value in st.items():
                where = f"optimizer/state/{pname}/{sname}"
                if is_tensor(value):
                    dt = data_type_of(value.dtype, tensor=where)
                    out.tensors.append(TensorSource(
                        node("optimizer", "state", pname, sname), tuple(value.shape), dt,
                        tensor_reader(value, where, mapped=True),
                        {"ucp": {"role": "optimizer_state"}},
                    ))
                else:
                    values[sname] = plain(value)
            if values:
                out.group_values(node("optimizer", "state", pname)).update(values)
        groups = []
        for g in optimizer["param_groups"]:
            doc = {k: plain(v) for k, v in g.items() if k not in ("params", "param_names")}
            doc["params"] = [by_id[int(i)] for i in g.get("params", [])]
            groups.append(doc)
        opt_values = out.group_values("optimizer")
        opt_values["param_groups"] = groups
    _training(out, rest, ("training",))
    if not out.groups.get("training", {}).get("values") and not any(
        t.path.startswith("training/") for t in out.tensors
    ):
        out.groups.pop("training", None)
    return out


def _training(out: Scan, values: Mapping[str, Any], where: tuple[str, ...]) -> None:
    """Tensors -> arrays, JSON-able values -> values, nested mappings -> groups."""
    group = node(*where)
    for key, value in values.items():
        name = str(key)
        if is_tensor(value):
            out.tensors.append(TensorSource(
                node(*where, name), tuple(value.shape), data_type_of(value.dtype, tensor=name),
                tensor_reader(value, name, mapped=True), {"ucp": {"role": "training_state"}},
            ))
        elif isinstance(value, Mapping) and any(
            is_tensor(v) or isinstance(v, Mapping) for v in value.values()
        ):
            _training(out, value, (*where, name))
        else:
            converted = plain(value)
            try:
                jsonvalues.encode(converted, where=name)
            except InvalidValueError:
                out.notes.append(f"{'/'.join(where)}/{name}: a {type(value).__name__}, "
                                 "neither a tensor nor JSON; left out")
                continue
            out.group_values(group)[name] = converted


__all__ = ["FORMAT", "detect", "is_torch_file", "optimizer_names", "scan"]
