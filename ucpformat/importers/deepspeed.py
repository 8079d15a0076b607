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

Tensor parallelism (``mp_rank_01``...: DeepSpeed AutoTP, Megatron-DeepSpeed, a model with
Megatron-style layers and an ``mpu``): each parameter is first rebuilt on each
model-parallel rank as above, then the ranks' shards are put together by their local
maps (``ucpformat.layout``): from a rule file (``rules=``, which also gives fused parts in
canonical order and the layout semantics written into the checkpoint), or else from the
categories of ``universal_checkpoint_info`` (replicated; split along dimension 0, or 1 for
row-parallel weights; two or more sub-parameters; vocabulary rows beyond
``original_vocab_size`` dropped).

Pipeline parallelism (``PipelineModule``): the module's weights and buffers are in one
``layer_XX[-model_YY]-model_states.pt`` per layer (and TP rank), the optimizer's in the
ZeRO files of each model-parallel rank ``mp_rank_MM`` (stage ``MM // tp``, TP rank
``MM % tp``). Names are the PipelineModule's own, global by construction
(``<layer>.<name>``, ``tied_modules.<key>.<name>``); a tensor held by several stages
(tied modules) is taken from the first. DeepSpeed's bf16 optimizer without ZeRO (flat
partitions without ``zero_stage``, the default of bf16 pipelines) is read like ZeRO-1.

DeepSpeed files are pickles that name a few DeepSpeed classes. They are loaded with
``torch.load(weights_only=True)`` and stand-ins for exactly those classes (see
``ucpformat.importers._torch``): DeepSpeed need not be installed, and nothing else a
file names is ever constructed. Mixture-of-experts files are not supported yet.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat.errors import FormatError, InvalidValueError, LayoutError, UnsupportedFeatureError
from ucpformat.format import dtypes, jsonvalues
from ucpformat.importers._engine import Scan, TensorSource, model_attributes, node
from ucpformat.importers._torch import drop_pages, load_restricted, plain, tensor_reader
from ucpformat.interchange import data_type_of, from_numpy, is_json_value, to_numpy
from ucpformat.layout import universal_info
from ucpformat.layout.boxes import Box, LocalMap, as_slices, contains, full_box
from ucpformat.layout.rank_slices import Conventions, ParallelConfig, RankCoords, local_map
from ucpformat.layout.rules import RuleSet
from ucpformat.layout.semantics import TensorLayout

FORMAT: Final = "deepspeed"
_OPTIM_RE = re.compile(r"^(?:(bf16|fp16)_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
#: a PipelineModule layer's state dict (``-model_YY`` with tensor parallelism)
_LAYER_RE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_EXPERT_RE = re.compile(r"^(?:layer_\d+_expert_\d+_mp_rank_\d+_model_states|"
                        r"expp_rank_\d+_mp_rank_\d+_optim_states)\.pt$")
#: PipelineModule's names: ``<global layer index>.<name>`` and ``tied_modules.<key>.<name>``
_LAYER_NAME = re.compile(r"^(\d+)\.")
_TIED_NAME = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")
#: model-states keys DeepSpeed itself writes (everything else is client state)
DS_KEYS: Final = frozenset({
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


# -- how the model-parallel ranks' local tensors make up a consolidated tensor -------------


@dataclass(frozen=True)
class _Plan:
    """A consolidated tensor: its shape, layout semantics, and each TP rank's local map."""

    shape: tuple[int, ...]
    layout: dict[str, Any]
    maps: tuple[LocalMap, ...]  # one per tensor-parallel rank
    read_ranks: tuple[int, ...]  # the ranks whose pieces are read (the others are replicas)

    @staticmethod
    def make(name: str, shape: tuple[int, ...], layout: dict[str, Any],
             maps: Sequence[LocalMap]) -> _Plan:
        from ucpformat.distributed import check_coverage

        check_coverage(name, shape, [p.glob for m in maps for p in m.pieces])
        kept: list[Box] = []
        ranks = []
        for t, m in enumerate(maps):
            new = [p.glob for p in m.pieces if not any(contains(k, p.glob) for k in kept)]
            if new:
                ranks.append(t)
                kept.extend(new)
        return _Plan(shape, layout, tuple(maps), tuple(ranks) or (0,))  # (0,): no elements

    def assemble(self, readers: Sequence[Callable[[], np.ndarray[Any, Any]]]
                 ) -> Callable[[], np.ndarray[Any, Any]]:
        """A reader of the consolidated tensor from the TP ranks' local readers."""
        if len(self.read_ranks) == 1:
            m = self.maps[self.read_ranks[0]]
            whole = full_box(self.shape)
            if (m.local_shape == self.shape and len(m.pieces) == 1
                    and m.pieces[0].local == whole and m.pieces[0].glob == whole):
                return readers[self.read_ranks[0]]

        def read() -> np.ndarray[Any, Any]:
            out: np.ndarray[Any, Any] | None = None
            for t in self.read_ranks:
                data = readers[t]()
                if out is None:
                    out = np.empty(self.shape, dtype=data.dtype)
                for piece in self.maps[t].pieces:
                    out[as_slices(piece.glob)] = data[as_slices(piece.local)]
            assert out is not None
            return out

        return read


@dataclass
class _Planner:
    """Layout semantics and local maps, from a rule file or ``universal_checkpoint_info``."""

    tp: int
    uci: Mapping[str, Any]
    rules: RuleSet | None
    params: Mapping[str, Any]
    pipeline: bool  # names carry PipelineModule's global layer index (``<layer>.<...>``)

    def plan(self, name: str, local_shapes: Sequence[tuple[int, ...]]
             ) -> _Plan | tuple[str, str | None]:
        """A plan, or ("ignore", None) / ("alias", target) for a rule file's ignore / tied_to."""
        first = local_shapes[0]
        cfg = ParallelConfig(tp=self.tp)
        if self.rules is not None:
            resolved = self.rules.resolve(name, self.params)
            if resolved is None:
                return "ignore", None
            if resolved.tied_to is not None:
                return "alias", resolved.tied_to
            layout, conv = resolved.layout, resolved.conventions
            if layout.experts_dim is not None or layout.layers_dim is not None:
                raise UnsupportedFeatureError("stacked experts or layers in a DeepSpeed "
                                              "checkpoint are not supported", tensor=name)
            vocab = self.rules.vocab_size_hint(name, self.params)
        else:
            layout, conv = self._uci_layout(name, first)
            vocab = None
        shape = list(first)
        if layout.vocab_dim is not None:
            d = layout.vocab_dim
            if vocab is None:
                vocab = universal_info.original_vocab_size(self.uci)
            if vocab is None:
                if self.tp > 1:
                    raise LayoutError("the vocabulary size is needed (rule parameter "
                                      "'vocab_size', or universal_checkpoint_info's "
                                      "original_vocab_size)", rule="UCP-1.0-R113", tensor=name)
                vocab = first[d]
            shape[d] = vocab
            # the padding the files hold: each rank's rows, whatever multiple made them
            conv = dataclasses.replace(conv, vocab_multiple=first[d])
        elif layout.tp_dim is not None:
            shape[layout.tp_dim] = sum(s[layout.tp_dim] for s in local_shapes)
        try:
            layout.check(tuple(shape), tensor=name)
            maps = []
            for t, local_shape in enumerate(local_shapes):
                m = local_map(shape, layout, conv, cfg, RankCoords(tp=t), zero3=False,
                              tensor=name)
                if m is None or m.local_shape != tuple(local_shape):
                    raise LayoutError(
                        f"tensor-parallel rank {t} holds shape {list(local_shape)}, the layout "
                        f"{layout.to_json()} gives {None if m is None else list(m.local_shape)}",
                        rule="UCP-1.0-R110", tensor=name)
                maps.append(m)
        except LayoutError as exc:
            source = (f"rule file {self.rules.name!r}" if self.rules is not None
                      else "universal_checkpoint_info")
            raise LayoutError(f"{source} does not fit this tensor: {exc.message}",
                              rule=exc.rule, tensor=name) from None
        doc = layout.to_json()
        numbered = _LAYER_NAME.match(name)
        if self.pipeline and self.rules is None and numbered is not None:
            doc["layer"] = int(numbered.group(1))
        return _Plan.make(name, tuple(shape), doc, maps)

    def _uci_layout(self, name: str, local_shape: tuple[int, ...]
                    ) -> tuple[TensorLayout, Conventions]:
        """What ``universal_checkpoint_info``'s categories say of a tensor."""
        return universal_info.tensor_layout(self.uci, name, local_shape, self.tp)


# -- the checkpoint's files ------------------------------------------------------------------


def _degrees(ms: Mapping[str, Any], n_mp: int, layer_files: Mapping[tuple[int, int], Path],
             where: Path) -> tuple[int, int]:
    """(pipeline, tensor-parallel) degrees; model-parallel rank m is stage m // tp, rank m % tp."""
    dims = ms.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping):
        pp, tp = dims.get("pp_degree"), dims.get("tp_degree")
        if isinstance(pp, int) and isinstance(tp, int) and pp >= 1 and tp >= 1 and pp * tp == n_mp:
            return pp, tp
    if layer_files:
        tp = len({t for _, t in layer_files})
        if n_mp % tp:
            raise FormatError(f"{n_mp} model states files for {tp} tensor-parallel ranks",
                              path=str(where))
        return n_mp // tp, tp
    return 1, n_mp


def _layer_tensors(
    layer_files: Mapping[tuple[int, int], Path],
    known: Mapping[str, int],
    named: bool,
    out: Scan,
) -> dict[str, dict[tuple[int, int], Any]]:
    """The module tensors of a pipeline checkpoint: global name -> {(stage, tp): tensor}.

    A layer file holds ``layer.state_dict()`` of the PipelineModule's layer ``<idx>``,
    whose global names are ``<idx>.<name>``, or, for a ``TiedLayerSpec``, those of
    ``tied_modules.<key>.<name>``. ``known`` (global name -> first stage holding it) comes
    from the model states files; ``named``: they list the parameters (``param_shapes``,
    written with a ZeRO optimizer), which tells tied modules apart.
    """
    tied: dict[str, set[str]] = {}
    for name in known:
        m = _TIED_NAME.match(name)
        if m:
            tied.setdefault(m.group(1), set()).add(m.group(2))
    starts: dict[int, int] = {}  # stage -> first layer index it holds
    for name, stage in known.items():
        m = _LAYER_NAME.match(name)
        if m:
            starts[stage] = min(starts.get(stage, int(m.group(1))), int(m.group(1)))

    def stage_of(idx: int) -> int:
        held = [s for s, first in starts.items() if first <= idx]
        return max(held) if held else 0

    found: dict[str, dict[tuple[int, int], Any]] = {}
    for (idx, t), f in sorted(layer_files.items()):
        sd = load_restricted(f)
        if not isinstance(sd, Mapping):
            raise FormatError("a layer file that is not a state dict", path=str(f))
        local = {str(k): v for k, v in sd.items() if hasattr(v, "dtype") and hasattr(v, "shape")}
        if not local:
            continue
        names = {k: f"{idx}.{k}" for k in local}
        if named and not all(g in known for g in names.values()):
            keys = [k for k, members in tied.items() if set(local) <= members]
            if len(keys) != 1:
                raise FormatError(
                    f"cannot tell which parameters layer {idx} holds: {sorted(local)} are "
                    f"neither '{idx}.<name>' nor one tied module's "
                    f"({'ambiguous: ' + str(keys) if keys else 'none matches'})", path=str(f))
            names = {k: f"tied_modules.{keys[0]}.{k}" for k in local}
        for k, g in names.items():
            stage = known.get(g, stage_of(idx))
            found.setdefault(g, {}).setdefault((stage, t), local[k])
    if not named:
        out.notes.append("the model states files name no parameters (no ZeRO optimizer): "
                         "layer files are named by their layer index, tied modules included")
    return found


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
    model_files: dict[tuple[int, int], Path] = {}  # (dp, mp) -> file
    optim_files: dict[tuple[int, int], Path] = {}
    layer_files: dict[tuple[int, int], Path] = {}  # (layer, tp) -> file
    for f in ckpt.iterdir():
        if _EXPERT_RE.match(f.name):
            raise UnsupportedFeatureError("DeepSpeed mixture-of-experts checkpoints (expert "
                                          "files) are not supported yet", path=str(f))
        if m := _MODEL_RE.match(f.name):
            model_files[(int(m.group(1) or 0), int(m.group(2)))] = f
        elif m := _OPTIM_RE.match(f.name):
            optim_files[(int(m.group(2)), int(m.group(3)))] = f
        elif m := _LAYER_RE.match(f.name):
            layer_files[(int(m.group(1)), int(m.group(2) or 0))] = f
    if not model_files:
        raise FormatError("no model states file", path=str(ckpt))
    mp_ranks = sorted({mp for _, mp in model_files})
    n_mp = len(mp_ranks)
    if mp_ranks != list(range(n_mp)):
        raise FormatError(f"model states of model-parallel ranks {mp_ranks}: some are missing",
                          path=str(ckpt))
    world = len(optim_files) // n_mp if optim_files else 0
    if optim_files and sorted(optim_files) != [(d, m) for d in range(world) for m in range(n_mp)]:
        raise FormatError(f"optimizer files of ranks {sorted(optim_files)}: some are missing",
                          path=str(ckpt))

    states = {k: load_restricted(f) for k, f in sorted(model_files.items())}
    ms = states[min(states)]
    if not isinstance(ms, Mapping) or "module" not in ms:
        raise FormatError("the model states file holds no 'module'", path=str(ckpt))
    pp, tp = _degrees(ms, n_mp, layer_files, ckpt)
    if layer_files and {t for _, t in layer_files} != set(range(tp)):
        raise FormatError(f"layer files of tensor-parallel ranks "
                          f"{sorted({t for _, t in layer_files})} for tp={tp}", path=str(ckpt))
    optims = {k: load_restricted(f)["optimizer_state_dict"] for k, f in sorted(optim_files.items())}
    # DeepSpeed's bf16 optimizer without ZeRO (BF16_Optimizer: the default of bf16 pipeline
    # runs) writes flat partitions like ZeRO-1's, with no zero_stage and no param_shapes
    bf16_optimizer = bool(optims) and all("zero_stage" not in o and "param_slice_mappings" in o
                                          for o in optims.values())
    stage = 1 if bf16_optimizer else _stage(optims[(0, 0)]) if optims else 0
    if stage == 3 and len(model_files) != len(optim_files):
        raise FormatError(f"ZeRO-3 needs one model states file per rank: {len(model_files)} "
                          f"files, {len(optim_files)} optimizer files", path=str(ckpt))
    uci = ms.get("universal_checkpoint_info") or {}
    if not isinstance(uci, Mapping):
        uci = {}
    rule_set = rules if isinstance(rules, RuleSet) or rules is None else RuleSet.load(
        os.fspath(rules))
    params_of_rules = dict(rule_params or {})
    if isinstance(uci.get("original_vocab_size"), int):
        params_of_rules.setdefault("vocab_size", uci["original_vocab_size"])
    if tp > 1 and not uci and rule_set is None:
        raise UnsupportedFeatureError(
            "tensor-parallel DeepSpeed checkpoints need a rule file (rules=...) or "
            "universal_checkpoint_info (written by AutoTP or Megatron-DeepSpeed) to tell how "
            "each parameter is split", path=str(ckpt))
    planner = _Planner(tp, uci, rule_set, params_of_rules, pipeline=bool(layer_files))

    def coords(mp: int) -> tuple[int, int]:
        return mp // tp, mp % tp

    first_state = {mp: states[min(k for k in states if k[1] == mp)] for mp in range(n_mp)}
    # the names of each flat group, where the model states do not list them (param_shapes)
    slice_names: dict[int, list[list[str]]] = {}
    for mp in range(n_mp):
        if optims and stage < 3 and not first_state[mp].get("param_shapes"):
            mappings = [optims[(d, mp)]["param_slice_mappings"] for d in range(world)]
            slice_names[mp] = [list(dict.fromkeys(str(n) for m in mappings for n in m[g]))
                               for g in range(len(mappings[0]))]
    buffer_names: set[str] = set()
    shared: dict[str, str] = {}
    frozen_shapes: dict[str, tuple[int, ...]] = {}
    known: dict[str, int] = {}  # global name -> first pipeline stage that holds it
    for mp in range(n_mp):
        st = first_state[mp]
        names = [str(b) for b in st.get("buffer_names") or []]
        buffer_names.update(names)
        shared.update({str(k): str(v) for k, v in dict(st.get("shared_params") or {}).items()})
        frozen = {str(k): tuple(int(s) for s in v)
                  for k, v in dict(st.get("frozen_param_shapes") or {}).items()}
        if mp == 0:
            frozen_shapes = frozen
        names += list(frozen)
        for group in list(st.get("param_shapes") or []) + slice_names.get(mp, []):
            names += [str(n) for n in group]
        for n in names:
            known.setdefault(n, coords(mp)[0])

    # module tensors: name -> {(stage, tp rank): tensor}
    module: dict[str, dict[tuple[int, int], Any]] = {}
    if layer_files:
        named = bool(slice_names) or any(first_state[mp].get("param_shapes")
                                         for mp in range(n_mp))
        module = _layer_tensors(layer_files, known, named, out)
    else:
        for mp in range(n_mp):
            for n, t in dict(first_state[mp]["module"] or {}).items():
                module.setdefault(str(n), {})[coords(mp)] = t

    # parameters trained by the optimizer: name -> {(stage, tp rank): _Param}, steps, groups
    params: dict[str, dict[tuple[int, int], _Param]] = {}
    steps: dict[str, Any] = {}
    param_groups: list[dict[str, Any]] = []
    for mp in range(n_mp):
        if not optims:
            break
        shapes_m = list(first_state[mp].get("param_shapes") or [])
        if mp in slice_names:  # the shapes of the module's (local) tensors
            shapes_m = [{n: _module_shape(module, n, coords(mp), ckpt) for n in group}
                        for group in slice_names[mp]]
        local, steps_m, groups_m = _flat_params(
            stage, {d: optims[(d, mp)] for d in range(world)}, shapes_m, ckpt)
        for n, p in local.items():
            params.setdefault(n, {})[coords(mp)] = p
            steps.setdefault(n, steps_m[n])
        for g, group in enumerate(groups_m):
            if g == len(param_groups):
                param_groups.append(group)
            else:
                names_g = param_groups[g]["params"]
                names_g.extend(n for n in group["params"] if n not in names_g)

    def holders(name: str, where: Mapping[tuple[int, int], Any]) -> list[Any]:
        """The TP ranks' local tensors at the first stage that holds ``name``."""
        s = min(c[0] for c in where)
        missing = [t for t in range(tp) if (s, t) not in where]
        if missing:
            raise FormatError(f"pipeline stage {s}: tensor-parallel ranks {missing} do not "
                              "hold this tensor", tensor=name, path=str(ckpt))
        return [where[(s, t)] for t in range(tp)]

    aliases: dict[str, str] = {}

    def plan(name: str, local_shapes: list[tuple[int, ...]]) -> _Plan | None:
        made = planner.plan(name, local_shapes)
        if isinstance(made, _Plan):
            return made
        action, target = made
        if action == "alias" and target is not None:
            aliases[name] = target
        else:
            out.notes.append(f"{name}: ignored (rule file)")
        return None

    # parameters trained by the optimizer
    for name, where in params.items():
        if name in shared:
            continue
        locs = holders(name, where)
        p_plan = plan(name, [p.shape for p in locs])
        if p_plan is None:
            continue
        lps = module.get(name)
        lp_locs = holders(name, lps) if lps else None
        lp_dtype = lp_locs[0].dtype if lp_locs else None
        lp_dt = (data_type_of(lp_dtype, tensor=name) if lp_dtype is not None
                 else dtypes.BY_NAME["float32"])
        attrs = model_attributes("parameter", p_plan.layout)
        shape = p_plan.shape

        def states_reader(state: str, out_dtype: Any = None, locs: list[_Param] = locs,
                          p_plan: _Plan = p_plan) -> Callable[[], np.ndarray[Any, Any]]:
            return p_plan.assemble([p.reader(state, out_dtype) for p in locs])

        if lp_dt.name == "float32":
            out.tensors.append(TensorSource(node("model", name), shape, lp_dt,
                                            states_reader("master"), attrs))
        else:
            if stage < 3 and lp_locs is not None and all(
                    tuple(lp.shape) == p.shape for lp, p in zip(lp_locs, locs, strict=True)):
                read = p_plan.assemble([tensor_reader(lp, name, mapped=True) for lp in lp_locs])
            else:  # ZeRO-3: the module holds placeholders; DeepSpeed rounds the master
                read = states_reader("master", out_dtype=lp_dtype)
            out.tensors.append(TensorSource(node("model", name), shape, lp_dt, read, attrs))
            out.tensors.append(TensorSource(
                node("optimizer", "state", name, "master"), shape, dtypes.BY_NAME["float32"],
                states_reader("master"), {"ucp": {"role": "optimizer_state"}},
            ))
        for state in sorted(locs[0].pieces[0].tensors if locs[0].pieces else ()):
            if state == "master":
                continue
            out.tensors.append(TensorSource(
                node("optimizer", "state", name, state), shape, dtypes.BY_NAME["float32"],
                states_reader(state), {"ucp": {"role": "optimizer_state"}},
            ))
        step = steps.get(name)
        if step is not None and hasattr(step, "dtype"):
            out.tensors.append(TensorSource(
                node("optimizer", "state", name, "step"), tuple(step.shape),
                data_type_of(step.dtype, tensor=name), tensor_reader(step, name),
                {"ucp": {"role": "optimizer_state"}},
            ))
        elif step is not None:
            out.group_values(node("optimizer", "state", name))["step"] = plain(step)

    # frozen parameters (ZeRO-2/3 record them apart), buffers, parameters of stage 0
    if frozen_shapes and (tp > 1 or pp > 1):
        raise UnsupportedFeatureError("frozen parameters under DeepSpeed tensor or pipeline "
                                      "parallelism are not supported yet", path=str(ckpt))
    fragments = [dict(states[k].get("frozen_param_fragments") or {}) for k in sorted(states)
                 if k[1] == 0]
    for name, fshape in frozen_shapes.items():
        f_plan = plan(name, [fshape])
        if f_plan is None:
            continue
        if stage == 3:
            numel = math.prod(fshape)
            part = -(-numel // world) if numel else 0
            frags = [f[name] for f in fragments]
            read = _frozen_reader(name, fshape, frags, part)
            dt = data_type_of(frags[0].dtype, tensor=name)
        else:
            t0 = fragments[0].get(name, module.get(name, {}).get((0, 0)))
            if t0 is None:
                raise FormatError("frozen parameter without values", tensor=name, path=str(ckpt))
            read, dt = tensor_reader(t0, name, mapped=True), data_type_of(t0.dtype, tensor=name)
        out.tensors.append(TensorSource(node("model", name), f_plan.shape, dt, read,
                                        model_attributes("parameter", f_plan.layout)))
    stored = set(params) | set(frozen_shapes)
    for name, where in module.items():
        if name in stored or name in shared:
            continue
        locs_m = holders(name, where)
        if stage == 3 and locs_m[0].numel() == 0:
            continue
        m_plan = plan(name, [tuple(t.shape) for t in locs_m])
        if m_plan is None:
            continue
        role = "buffer" if name in buffer_names else "parameter"
        if role == "parameter" and optims:
            out.notes.append(f"{name}: in the module but in no optimizer group; stored as saved")
        out.tensors.append(TensorSource(
            node("model", name), m_plan.shape, data_type_of(locs_m[0].dtype, tensor=name),
            m_plan.assemble([tensor_reader(t, name, mapped=True) for t in locs_m]),
            model_attributes(role, m_plan.layout)))
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
        if key not in DS_KEYS:
            if hasattr(value, "dtype") and hasattr(value, "shape"):
                out.tensors.append(TensorSource(node("training", str(key)), tuple(value.shape),
                                                data_type_of(value.dtype, tensor=str(key)),
                                                tensor_reader(value, str(key)),
                                                {"ucp": {"role": "training_state"}}))
            else:
                training[str(key)] = _json(value, out, str(key))
    source: dict[str, Any] = {
        "format": FORMAT,
        "tag": ckpt.name,
        "ds_version": str(ms.get("ds_version", "")),
        "zero_stage": 0 if bf16_optimizer else stage,
        "dp_world_size": world or int(ms.get("dp_world_size") or 1),
        "tp_world_size": tp,
        "pp_world_size": pp,
    }
    if bf16_optimizer:
        source["optimizer"] = "bf16 (flat partitions without ZeRO)"
    if layer_files:
        source["pp_stage_layers"] = _stage_layers(known, module, pp)
    if rule_set is not None:
        source["rules"] = rule_set.name
        source["rule_params"] = {k: v for k, v in params_of_rules.items() if is_json_value(v)}
    source["ds_config"] = _json(ms.get("ds_config") or {}, out, "ds_config")
    out.metadata["source"] = source
    return out


def _module_shape(module: Mapping[str, Mapping[tuple[int, int], Any]], name: str,
                  at: tuple[int, int], where: Path) -> tuple[int, ...]:
    """The local shape of parameter ``name`` on model-parallel rank ``at`` (stage, tp)."""
    held = module.get(name, {})
    t = held.get(at)
    if t is None:  # a tied module: the first stage's copy has the same shape
        t = next((v for (_, tp), v in sorted(held.items()) if tp == at[1]), None)
    if t is None:
        raise FormatError("the optimizer partitions hold a parameter the model files do not",
                          tensor=name, path=str(where))
    return tuple(int(n) for n in t.shape)


def _stage_layers(known: Mapping[str, int], module: Mapping[str, Mapping[tuple[int, int], Any]],
                  pp: int) -> list[list[int]]:
    """Per pipeline stage, the first and last global layer index holding tensors."""
    spans: dict[int, list[int]] = {}
    names = {**{n: s for n, s in known.items()},
             **{n: min(c[0] for c in where) for n, where in module.items() if n not in known}}
    for name, s in names.items():
        m = _LAYER_NAME.match(name)
        if m:
            idx = int(m.group(1))
            lo, hi = spans.get(s, [idx, idx])
            spans[s] = [min(lo, idx), max(hi, idx)]
    return [spans.get(s, []) for s in range(pp)]


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


__all__ = ["DS_KEYS", "FORMAT", "detect", "scan", "tag_dir"]
