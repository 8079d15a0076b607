"""DeepSpeed ZeRO checkpoints (stage 0-3, fp32, bf16 or fp16) -> UCP.

A DeepSpeed checkpoint directory holds ``latest`` (the newest tag) and one directory
per tag with the model states (``mp_rank_00_model_states.pt``, or one
``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank under ZeRO-3) and one
optimizer file per data-parallel rank (``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``).

The optimizer files hold *flat partitions*: under ZeRO-1/2, each parameter group is one
flat fp32 buffer cut into equal contiguous parts, one per rank, so parameters straddle
ranks; ``param_slice_mappings`` says where each parameter's fragment lies in each
rank's part (the last part may be padded). Under ZeRO-3 every parameter is padded to
``ceil(numel / world)`` elements per rank, in ``param_shapes`` order. The Adam moments
(``exp_avg``, ``exp_avg_sq``) are flat buffers laid out the same way. This importer
puts each parameter back together, tensor by tensor, from memory-mapped files:

* ``model/<p>``: the weights in the training dtype (bf16 runs keep bf16: the module's
  own copy under ZeRO-1/2, the fp32 master rounded to nearest under ZeRO-3, which is
  what DeepSpeed itself copies into the module); buffers as saved;
* ``optimizer/state/<p>/master``: the fp32 master weights, only when the training dtype
  is not fp32 (in fp32 runs ``model/<p>`` *is* the master);
* ``optimizer/state/<p>/exp_avg``, ``exp_avg_sq`` (fp32, at the parameter's shape) and
  ``step``; the optimizer's hyperparameters as ``param_groups``;
* ``training``: ``step`` (``global_steps``), ``global_samples``, ``skipped_steps``,
  the learning-rate scheduler's state and other client state when it is JSON.

Tensor parallelism (``mp_rank_01``...: DeepSpeed AutoTP, Megatron-DeepSpeed): each
parameter is first rebuilt on each model-parallel rank as above, then the ranks' shards
are joined as ``universal_checkpoint_info`` says (replicated; split along dimension 0,
or 1 for row-parallel weights; vocabulary rows beyond ``original_vocab_size`` dropped),
and that is what the layout semantics record (``tp``, ``vocab``) unless a rule file is
given.

DeepSpeed files are pickles that name a few DeepSpeed classes. They are loaded with
``torch.load(weights_only=True)`` and stand-ins for exactly those classes (see
``ucpformat.importers._torch``): DeepSpeed need not be installed, and nothing else a
file names is ever constructed. Pipeline-parallel checkpoints (``layer_*`` files) and
fused sub-parameters are not supported yet.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat import dtypes, jsonvalues
from ucpformat.errors import FormatError, InvalidValueError, UnsupportedFeatureError
from ucpformat.importers._engine import Annotator, Scan, TensorSource, model_attributes, node
from ucpformat.importers._torch import (
    data_type_of,
    drop_pages,
    from_numpy,
    load_restricted,
    plain,
    tensor_reader,
    to_numpy,
)
from ucpformat.layout.rules import RuleSet

FORMAT: Final = "deepspeed"
_OPTIM_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
#: model-states keys DeepSpeed itself writes (everything else is client state)
_DS_KEYS: Final = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
    "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
    "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info",
})


def tag_dir(path: Path, tag: str | None = None) -> Path:
    """The directory of one checkpoint (the tag): ``path/<tag>``, or ``path`` itself."""
    if tag is not None:
        found = path / tag
        if not found.is_dir():
            raise FormatError(f"no tag directory {tag!r}", path=str(path))
        return found
    if any(_MODEL_RE.match(p.name) for p in path.glob("*_model_states.pt")):
        return path
    latest = path / "latest"
    if latest.is_file():
        name = latest.read_text(encoding="utf-8").strip()
        if not name or "/" in name or name in (".", ".."):
            raise FormatError(f"'latest' names {name!r}", path=str(latest))
        return tag_dir(path, name)
    raise FormatError("not a DeepSpeed checkpoint: no *_model_states.pt and no 'latest' file",
                      path=str(path))


def detect(path: Path) -> bool:
    if not path.is_dir():
        return False
    if any(_MODEL_RE.match(p.name) for p in path.glob("*_model_states.pt")):
        return True
    latest = path / "latest"
    if latest.is_file():
        try:
            name = latest.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError):
            return False
        tagged = path / name
        return bool(name) and tagged.is_dir() and any(tagged.glob("*_model_states.pt"))
    return False


@dataclass
class _Piece:
    """Elements [start, start + numel) of a flat buffer, in order of the parameter."""

    tensors: Mapping[str, Any]  # state name -> flat (mapped) tensor of one rank
    start: int
    numel: int


class _Param:
    """Where one parameter's fragments are, in every rank's flat buffers."""

    def __init__(self, name: str, shape: tuple[int, ...], pieces: list[_Piece]) -> None:
        self.name = name
        self.shape = shape
        self.pieces = pieces
        got = sum(p.numel for p in pieces)
        if got != math.prod(shape):
            raise FormatError(
                f"the ranks' fragments hold {got} elements, the shape {list(shape)} needs "
                f"{math.prod(shape)}", tensor=name,
            )

    def reader(self, state: str, out_dtype: Any = None) -> Callable[[], np.ndarray[Any, Any]]:
        def read() -> np.ndarray[Any, Any]:
            parts = []
            for piece in self.pieces:
                flat = piece.tensors[state]
                if piece.start + piece.numel > flat.numel():
                    raise FormatError(f"{state}: fragment past the end of its flat buffer",
                                      tensor=self.name)
                view = flat.narrow(0, piece.start, piece.numel)
                parts.append(np.array(to_numpy(view, name=self.name), copy=True))
                drop_pages(view)
            data = (np.concatenate(parts) if parts else np.empty(0, np.float32))
            data = data.reshape(self.shape)
            if out_dtype is not None:
                data = to_numpy(from_numpy(data).to(out_dtype), name=self.name)
            return data

        return read


def _stage(osd: Mapping[str, Any]) -> int:
    stage = osd.get("zero_stage")
    try:
        return int(stage)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise FormatError(f"unknown zero_stage {stage!r}") from None


def _flat_params(
    stage: int,
    optims: Mapping[int, Mapping[str, Any]],
    param_shapes: list[Mapping[str, Any]],
    where: Path,
) -> tuple[dict[str, _Param], dict[str, Any], list[dict[str, Any]]]:
    """The parameters of one model-parallel rank, from its data-parallel ranks' partitions.

    Returns (name -> parameter, name -> step, param groups).
    """
    world = len(optims)
    params: dict[str, _Param] = {}
    steps: dict[str, Any] = {}
    param_groups: list[dict[str, Any]] = []
    for g, shapes in enumerate(param_shapes):
        names = [str(n) for n in shapes]
        per_rank = []
        for r in range(world):
            osd = optims[r]
            base = osd["base_optimizer_state"] if stage < 3 else osd["optimizer_state_dict"]
            flat_key = "single_partition_of_fp32_groups" if stage < 3 else "fp32_flat_groups"
            pg = base["param_groups"][g]
            key = pg["params"][0]
            st = dict(base["state"].get(key, {}))
            tensors = {k: v for k, v in st.items() if k != "step" and hasattr(v, "narrow")}
            tensors["master"] = osd[flat_key][g]
            per_rank.append((tensors, st.get("step"), pg))
        hyper = {k: plain(v) for k, v in per_rank[0][2].items() if k != "params"}
        hyper["params"] = names
        param_groups.append(hyper)
        if stage < 3:
            for name in names:
                pieces = []
                for r in range(world):
                    addr = optims[r]["param_slice_mappings"][g].get(name)
                    if addr is not None:
                        pieces.append(_Piece(per_rank[r][0], int(addr.start), int(addr.numel)))
                params[name] = _Param(name, tuple(int(s) for s in shapes[name]), pieces)
        else:
            offset = 0
            for name in names:
                shape = tuple(int(s) for s in shapes[name])
                numel = math.prod(shape)
                part = -(-numel // world) if numel else 0
                pieces = []
                for r in range(world):
                    take = max(0, min(part, numel - r * part))
                    if take:
                        pieces.append(_Piece(per_rank[r][0], offset, take))
                params[name] = _Param(name, shape, pieces)
                offset += part
            for r in range(world):
                size = per_rank[r][0]["master"].numel()
                if size < offset:
                    raise FormatError(f"rank {r}: the flat fp32 group {g} has {size} elements, "
                                      f"its parameters need {offset}", path=str(where))
        for name in names:
            steps[name] = per_rank[0][1]
    return params, steps, param_groups


class _Joined:
    """A tensor-parallel parameter: its shards on the model-parallel ranks, concatenated."""

    def __init__(self, name: str, shards: list[Any], cat_dim: int | None,
                 trim: int | None = None) -> None:
        self.name = name
        self.shards = shards
        self.cat_dim = cat_dim
        self.trim = trim
        first = shards[0].shape
        if cat_dim is None:
            shape = tuple(first)
        else:
            if any(len(s.shape) != len(first) or any(
                a != b for d, (a, b) in enumerate(zip(s.shape, first, strict=True)) if d != cat_dim
            ) for s in shards):
                raise FormatError("tensor-parallel shards of different shapes", tensor=name)
            total = sum(s.shape[cat_dim] for s in shards)
            if trim is not None:
                total = min(total, trim)
            shape = tuple(total if d == cat_dim else n for d, n in enumerate(first))
        self.shape = shape
        self.pieces = shards[0].pieces

    def reader(self, state: str, out_dtype: Any = None) -> Callable[[], np.ndarray[Any, Any]]:
        readers = [s.reader(state, out_dtype) for s in self.shards]
        if self.cat_dim is None:
            first: Callable[[], np.ndarray[Any, Any]] = readers[0]
            return first
        dim = self.cat_dim

        def read() -> np.ndarray[Any, Any]:
            data = np.concatenate([r() for r in readers], axis=dim)
            if data.shape[dim] != self.shape[dim]:
                keep = (slice(None),) * dim + (slice(0, self.shape[dim]),)
                data = np.ascontiguousarray(data[keep])
            return data

        return read


def _tp_semantics(name: str, uci: Mapping[str, Any]) -> tuple[int | None, bool]:
    """(concatenation dim or None for replicated, vocabulary?) from universal_checkpoint_info."""

    def hit(key: str) -> bool:
        return any(re.match(p, name) for p in uci.get(key, []) or [])

    if uci.get("parameter_with_sub_params") and hit("parameter_with_sub_params"):
        raise UnsupportedFeatureError("fused sub-parameters of DeepSpeed tensor parallelism are "
                                      "not supported yet", tensor=name)
    if hit("tp_replicated_parameter_patterns"):
        return None, False
    if hit("vocabulary_parameter_patterns"):
        return 0, True
    if hit("parameter_with_row_parallelism_patterns"):
        return 1, False
    return 0, False


def scan(
    path: Path,
    *,
    tag: str | None = None,
    rules: str | os.PathLike[str] | RuleSet | None = None,
    rule_params: Mapping[str, Any] | None = None,
) -> Scan:
    """The parameters, optimizer state and training state of a DeepSpeed checkpoint."""
    ckpt = tag_dir(path, tag)
    out = Scan(FORMAT, str(path))
    annotator = Annotator.make(rules, rule_params)
    model_files: dict[tuple[int, int], Path] = {}  # (dp, mp) -> file
    for f in ckpt.glob("*_model_states.pt"):
        m = _MODEL_RE.match(f.name)
        if m:
            model_files[(int(m.group(1) or 0), int(m.group(2)))] = f
    if any(ckpt.glob("layer_*")):
        raise UnsupportedFeatureError(
            "pipeline-parallel DeepSpeed checkpoints (layer_* files) are not supported yet",
            path=str(ckpt),
        )
    optim_files: dict[tuple[int, int], Path] = {}
    for f in ckpt.glob("*_optim_states.pt"):
        m = _OPTIM_RE.match(f.name)
        if m:
            optim_files[(int(m.group(2)), int(m.group(3)))] = f
    if not model_files:
        raise FormatError("no model states file", path=str(ckpt))
    mp_ranks = sorted({mp for _, mp in model_files})
    tp = len(mp_ranks)
    if mp_ranks != list(range(tp)):
        raise FormatError(f"model states of model-parallel ranks {mp_ranks}: some are missing",
                          path=str(ckpt))
    world = len(optim_files) // tp if optim_files else 0
    if optim_files and sorted(optim_files) != [(d, m) for d in range(world) for m in range(tp)]:
        raise FormatError(f"optimizer files of ranks {sorted(optim_files)}: some are missing",
                          path=str(ckpt))

    states = {k: load_restricted(f) for k, f in sorted(model_files.items())}
    ms = states[min(states)]
    if not isinstance(ms, Mapping) or "module" not in ms:
        raise FormatError("the model states file holds no 'module'", path=str(ckpt))
    optims = {k: load_restricted(f)["optimizer_state_dict"] for k, f in sorted(optim_files.items())}
    stage = _stage(optims[(0, 0)]) if optims else 0
    if stage == 3 and len(model_files) != len(optim_files):
        raise FormatError(f"ZeRO-3 needs one model states file per rank: {len(model_files)} "
                          f"files, {len(optim_files)} optimizer files", path=str(ckpt))
    uci = ms.get("universal_checkpoint_info") or {}
    if tp > 1 and not uci:
        raise UnsupportedFeatureError(
            "tensor-parallel DeepSpeed checkpoints need universal_checkpoint_info (written by "
            "AutoTP or Megatron-DeepSpeed) to tell how each parameter is split",
            path=str(ckpt),
        )
    module_of = [dict(states[min(k for k in states if k[1] == m)]["module"] or {})
                 for m in range(tp)]
    module: Mapping[str, Any] = module_of[0]

    buffer_names = [str(b) for b in ms.get("buffer_names") or []]
    shared = {str(k): str(v) for k, v in dict(ms.get("shared_params") or {}).items()}
    frozen_shapes = {str(k): tuple(int(s) for s in v)
                     for k, v in dict(ms.get("frozen_param_shapes") or {}).items()}

    params: dict[str, Any] = {}
    group_state: dict[str, dict[str, Any]] = {}  # param -> {"step": ...}
    param_groups: list[dict[str, Any]] = []
    tp_layout: dict[str, dict[str, Any]] = {}
    if optims:
        per_mp = []
        for mp in range(tp):
            shapes_m = list(states[min(k for k in states if k[1] == mp)].get("param_shapes")
                            or [])
            per_mp.append(_flat_params(stage, {d: optims[(d, mp)] for d in range(world)},
                                       shapes_m, ckpt))
        param_groups = per_mp[0][2]
        for name, first in per_mp[0][0].items():
            if tp == 1:
                params[name] = first
            else:
                dim, vocab = _tp_semantics(name, uci)
                trim = uci.get("original_vocab_size") if vocab else None
                params[name] = _Joined(name, [pm[0][name] for pm in per_mp], dim,
                                       trim if isinstance(trim, int) else None)
                doc: dict[str, Any] = {}
                if dim is not None:
                    doc["tp"] = {"dim": dim}
                if vocab:
                    doc["vocab"] = {"dim": 0}
                tp_layout[name] = doc
            group_state[name] = {"step": per_mp[0][1][name]}
        if tp > 1:
            module = {n: t for n, t in module.items() if n not in params}

    aliases: dict[str, str] = {}

    def keep(name: str, shape: tuple[int, ...]) -> dict[str, Any] | None:
        """Layout semantics of a model tensor, or None when it is not stored."""
        if annotator.rules is None and name in tp_layout:
            return tp_layout[name]  # what universal_checkpoint_info says
        action, layout, target = annotator.resolve(name, shape)
        if action == "ignore":
            out.notes.append(f"{name}: ignored (rule file)")
            return None
        if action == "alias" and target is not None:
            aliases[name] = target
            return None
        return layout or {}

    # parameters trained by the optimizer
    for name, p in params.items():
        layout = keep(name, p.shape)
        if layout is None:
            continue
        lp = module_of[0].get(name)
        lp_dtype = lp.dtype if lp is not None else None
        lp_dt = data_type_of(lp_dtype, tensor=name) if lp_dtype is not None else dtypes.BY_NAME[
            "float32"]
        attrs = model_attributes("parameter", layout)
        if lp_dt.name == "float32":
            out.tensors.append(TensorSource(node("model", name), p.shape, lp_dt,
                                            p.reader("master"), attrs))
        else:
            if stage < 3 and tp == 1 and lp is not None and tuple(lp.shape) == p.shape:
                read = tensor_reader(lp, name, mapped=True)
            else:
                read = p.reader("master", out_dtype=lp_dtype)
            out.tensors.append(TensorSource(node("model", name), p.shape, lp_dt, read, attrs))
            out.tensors.append(TensorSource(
                node("optimizer", "state", name, "master"), p.shape, dtypes.BY_NAME["float32"],
                p.reader("master"), {"ucp": {"role": "optimizer_state"}},
            ))
        for state in sorted(p.pieces[0].tensors if p.pieces else ()):
            if state == "master":
                continue
            out.tensors.append(TensorSource(
                node("optimizer", "state", name, state), p.shape, dtypes.BY_NAME["float32"],
                p.reader(state), {"ucp": {"role": "optimizer_state"}},
            ))
        step = group_state.get(name, {}).get("step")
        if step is not None and hasattr(step, "dtype"):
            out.tensors.append(TensorSource(
                node("optimizer", "state", name, "step"), tuple(step.shape),
                data_type_of(step.dtype, tensor=name), tensor_reader(step, name),
                {"ucp": {"role": "optimizer_state"}},
            ))
        elif step is not None:
            out.group_values(node("optimizer", "state", name))["step"] = plain(step)

    # frozen parameters, buffers, and parameters of stage 0 (no optimizer partitions)
    fragments = [dict(states[k].get("frozen_param_fragments") or {}) for k in sorted(states)
                 if k[1] == 0]
    if frozen_shapes and tp > 1:
        raise UnsupportedFeatureError("frozen parameters under DeepSpeed tensor parallelism are "
                                      "not supported yet", path=str(ckpt))
    for name, shape in frozen_shapes.items():
        layout = keep(name, shape)
        if layout is None:
            continue
        if stage == 3:
            numel = math.prod(shape)
            part = -(-numel // world) if numel else 0
            frags = [f[name] for f in fragments]
            read = _frozen_reader(name, shape, frags, part)
            dt = data_type_of(frags[0].dtype, tensor=name)
        else:
            t = fragments[0].get(name, module.get(name))
            if t is None:
                raise FormatError("frozen parameter without values", tensor=name, path=str(ckpt))
            read, dt = tensor_reader(t, name, mapped=True), data_type_of(t.dtype, tensor=name)
        out.tensors.append(TensorSource(node("model", name), shape, dt, read,
                                        model_attributes("parameter", layout)))
    stored = set(params) | set(frozen_shapes)
    for name, t in module.items():
        if name in stored or name in shared:
            continue
        if name in params or (t.numel() == 0 and stage == 3):
            continue
        layout = keep(name, tuple(t.shape))
        if layout is None:
            continue
        role = "buffer" if name in buffer_names else "parameter"
        if role == "parameter" and optims:
            out.notes.append(f"{name}: in the module but in no optimizer group; stored as saved")
        out.tensors.append(TensorSource(node("model", name), tuple(t.shape),
                                        data_type_of(t.dtype, tensor=name),
                                        tensor_reader(t, name, mapped=True),
                                        model_attributes(role, layout)))
    if not optims and ms.get("optimizer") is not None:
        out.notes.append("the optimizer state of this ZeRO-0 checkpoint (a torch.optim state "
                         "numbered by DeepSpeed) is not imported")
    aliases.update(shared)
    if aliases:
        out.groups.setdefault("model", {})["aliases"] = aliases

    if param_groups:
        opt = out.group_values("optimizer")
        opt["param_groups"] = param_groups
        cfg = ms.get("ds_config") or {}
        otype = cfg.get("optimizer", {}).get("type") if isinstance(cfg, Mapping) else None
        if isinstance(otype, str):
            opt["type"] = f"deepspeed:{otype}"
        if stage and any(t.path.endswith("/master") for t in out.tensors):
            opt["master_weights"] = "master"
    training = out.group_values("training")
    if ms.get("global_steps") is not None:
        training["step"] = int(ms["global_steps"])
    for key in ("global_samples", "skipped_steps", "lr_scheduler", "data_sampler", "random_ltd"):
        if ms.get(key) is not None:
            training[key] = _json(ms[key], out, key)
    for key, value in ms.items():
        if key not in _DS_KEYS:
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                out.tensors.append(TensorSource(node("training", str(key)), tuple(value.shape),
                                                data_type_of(value.dtype, tensor=str(key)),
                                                tensor_reader(value, str(key)),
                                                {"ucp": {"role": "training_state"}}))
            else:
                training[str(key)] = _json(value, out, str(key))
    out.metadata["source"] = {
        "format": FORMAT,
        "tag": ckpt.name,
        "ds_version": str(ms.get("ds_version", "")),
        "zero_stage": stage,
        "dp_world_size": world or int(ms.get("dp_world_size") or 1),
        "tp_world_size": tp,
        "ds_config": _json(ms.get("ds_config") or {}, out, "ds_config"),
    }
    return out


def _frozen_reader(name: str, shape: tuple[int, ...], frags: Sequence[Any],
                   part: int) -> Callable[[], np.ndarray[Any, Any]]:
    def read() -> np.ndarray[Any, Any]:
        numel = math.prod(shape)
        flat = np.concatenate([np.array(to_numpy(f.reshape(-1)[:part], name=name), copy=True)
                               for f in frags])
        if flat.size < numel:
            raise FormatError("frozen fragments hold too few elements", tensor=name)
        return flat[:numel].reshape(shape)

    return read


def _json(value: Any, out: Scan, where: str) -> Any:
    converted = plain(value)
    try:
        jsonvalues.encode(converted, where=where)
    except InvalidValueError:
        out.notes.append(f"{where}: a {type(value).__name__}, not JSON; left out")
        return None
    return converted


__all__ = ["FORMAT", "detect", "scan", "tag_dir"]
