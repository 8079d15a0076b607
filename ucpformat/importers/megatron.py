"""Megatron-LM legacy per-rank checkpoints -> UCP, through the ``megatron-gpt`` rule file.

Layout (Megatron-LM's ``--ckpt-format torch``)::

    CKPT/latest_checkpointed_iteration.txt       "1000" (or "release")
    CKPT/iter_0001000/mp_rank_00/model_optim_rng.pt        tensor parallel only
    CKPT/iter_0001000/mp_rank_01_003/model_optim_rng.pt    TP rank 1, pipeline stage 3

Each file holds one rank's local model (``model``: tensor-parallel shards; fused QKV
interleaved per query group; SwiGLU ``linear_fc1`` as [gate; up] per rank; the
vocabulary padded to a multiple of ``make_vocab_size_divisible_by * tp``; layer numbers
local to the pipeline stage), ``args``, ``iteration`` and RNG states. The rule file
(default: the shipped ``megatron-gpt``; ``rules=`` for another) turns every local
tensor into pieces of the consolidated tensor (spec chapter "Layout semantics"); the
rule parameters come from ``args`` (``num_attention_heads``, ``num_query_groups``,
``kv_channels``, ``ffn_hidden_size``, ``swiglu``...), and ``rule_params`` overrides or
completes them. The real vocabulary size is in ``args.vocab_size`` only for some
tokenizers: give ``rule_params={"vocab_size": N}`` otherwise.

Files are loaded with ``torch.load(weights_only=True, mmap=True)`` plus stand-ins for
``argparse.Namespace``, numpy RNG state and Megatron's ``AttnBackend`` enum. Each
consolidated tensor is assembled from the ranks' mapped tensors when it is written.
The optimizer state of legacy checkpoints (numbered, or in ``distrib_optim.pt``) is not
imported yet; the import says so.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ucpformat.distributed.framework import ModelLayout
from ucpformat.errors import FormatError, InvalidValueError, LayoutError, UnsupportedFeatureError
from ucpformat.format import dtypes
from ucpformat.importers._engine import Scan, TensorSource
from ucpformat.importers._torch import STAND_INS, load_restricted, plain
from ucpformat.interchange import is_json_value, to_numpy
from ucpformat.layout.boxes import Box, as_slices, box_shape, contains, full_box
from ucpformat.layout.rank_slices import ParallelConfig, RankCoords
from ucpformat.layout.rules import RuleSet

FORMAT: Final = "megatron"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")


class AttnBackendStandIn(enum.Enum):
    """``megatron.core.transformer.enums.AttnBackend``."""

    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


MEGATRON_STAND_INS: Final[dict[str, Any]] = {
    **STAND_INS,
    "megatron.core.transformer.enums.AttnBackend": AttnBackendStandIn,
}


def iteration_dir(path: Path, iteration: str | None = None) -> Path:
    """The directory of one saved iteration: ``iter_`` and the iteration in seven digits
    (``iter_0000100``), or ``release``."""
    if iteration is not None:
        name = iteration if not iteration.isdigit() else f"iter_{int(iteration):07d}"
        found = path / name
        if not found.is_dir():
            raise FormatError(f"no iteration directory {name!r}", path=str(path))
        return found
    if any(_RANK_DIR.match(p.name) for p in path.iterdir() if p.is_dir()):
        return path
    tracker = path / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        raise FormatError("not a Megatron-LM checkpoint: no latest_checkpointed_iteration.txt "
                          "and no mp_rank_* directories", path=str(path))
    text = tracker.read_text(encoding="utf-8").strip()
    if text != "release" and not text.isdigit():
        raise FormatError(f"latest_checkpointed_iteration.txt says {text!r}", path=str(tracker))
    return iteration_dir(path, text)


def detect(path: Path) -> bool:
    if not path.is_dir():
        return False
    if (path / "latest_checkpointed_iteration.txt").is_file():
        return True
    return any(
        _RANK_DIR.match(p.name) and (p / "model_optim_rng.pt").is_file()
        for p in path.iterdir() if p.is_dir()
    )


def rule_params_from_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """The ``megatron-gpt`` rule parameters Megatron-LM's arguments give."""
    heads = args.get("num_attention_heads")
    hidden = args.get("hidden_size")
    out: dict[str, Any] = {}
    if isinstance(heads, int):
        out["num_attention_heads"] = heads
        groups = args.get("num_query_groups") if args.get("group_query_attention") else None
        out["num_query_groups"] = groups if isinstance(groups, int) else heads
        kv = args.get("kv_channels")
        if not isinstance(kv, int) and isinstance(hidden, int):
            kv = hidden // heads
        out["kv_channels"] = kv
    for key in ("ffn_hidden_size", "moe_ffn_hidden_size", "num_experts", "vocab_size"):
        if isinstance(args.get(key), int):
            out[key] = args[key]
    out["gated_linear_unit"] = bool(args.get("swiglu", False))
    out["tie_word_embeddings"] = not bool(args.get("untie_embeddings_and_output_weights", False))
    if isinstance(args.get("make_vocab_size_divisible_by"), int):
        out["vocab_multiple"] = args["make_vocab_size_divisible_by"]
    return out


def scan(
    path: Path,
    *,
    tag: str | None = None,
    rules: str | os.PathLike[str] | RuleSet | None = None,
    rule_params: Mapping[str, Any] | None = None,
) -> Scan:
    """The consolidated model of a Megatron-LM legacy checkpoint (``tag``: an iteration)."""
    it_dir = iteration_dir(path, tag)
    ranks: dict[tuple[int, int], Path] = {}
    for d in sorted(it_dir.iterdir()):
        m = _RANK_DIR.match(d.name) if d.is_dir() else None
        if m is None:
            continue
        f = d / "model_optim_rng.pt"
        if not f.is_file():
            raise FormatError("a rank directory without model_optim_rng.pt", path=str(d))
        ranks[(int(m.group(1)), int(m.group(2) or 0))] = f
    if not ranks:
        raise FormatError("no mp_rank_* directories", path=str(it_dir))
    tp = 1 + max(t for t, _ in ranks)
    pp = 1 + max(p for _, p in ranks)
    if len(ranks) != tp * pp:
        raise FormatError(f"{len(ranks)} rank directories for tp={tp} x pp={pp}: some are "
                          "missing", path=str(it_dir))
    if any(it_dir.glob("*/distrib_optim.pt")):
        note_opt = "the distributed optimizer's state (distrib_optim.pt) is not imported"
    else:
        note_opt = "the optimizer state of legacy checkpoints is not imported"
    loaded = {k: load_restricted(f, stand_ins=MEGATRON_STAND_INS) for k, f in ranks.items()}
    first = loaded[(0, 0)]
    args_obj = first.get("args")
    args: dict[str, Any] = plain(args_obj) if args_obj is not None else {}
    if not isinstance(args, dict):
        args = {}
    if any(k.startswith("model") and k != "model" for k in first if isinstance(k, str)):
        raise UnsupportedFeatureError("virtual pipeline stages (model0, model1, ...) are not "
                                      "supported yet", path=str(it_dir))
    num_layers = args.get("num_layers")
    params = rule_params_from_args(args)
    params.update(rule_params or {})
    rule_set = rules if isinstance(rules, RuleSet) else RuleSet.load(
        os.fspath(rules) if rules is not None else "megatron-gpt")
    if not isinstance(num_layers, int):
        num_layers = params.get("num_layers")
    if pp > 1 and not isinstance(num_layers, int):
        raise InvalidValueError("num_layers is needed to renumber pipeline stages' layers "
                                "(args has none; give rule_params={'num_layers': N})")
    cfg = ParallelConfig(tp=tp, pp=pp, num_layers=num_layers if isinstance(num_layers, int)
                         else None)
    layout = ModelLayout(rule_set, params, cfg)

    out = Scan(FORMAT, str(path))
    pieces: dict[str, list[tuple[Box, np.ndarray[Any, Any]]]] = {}
    specs: dict[str, Any] = {}
    aliases: dict[str, str] = {}
    for (t, p), state in sorted(loaded.items()):
        model = state.get("model")
        if not isinstance(model, Mapping):
            raise FormatError("the file has no 'model' state dict", path=str(ranks[(t, p)]))
        local = {k: to_numpy(v, name=k) for k, v in model.items()
                 if hasattr(v, "dtype") and hasattr(v, "shape")}
        skipped = [k for k in model if k not in local]
        rank = cfg.rank(RankCoords(tp=t, pp=p))
        try:
            rank_specs, frags, rank_aliases = layout.fragments(rank, local)
        except LayoutError as exc:
            raise LayoutError(f"rank tp={t} pp={p}: {exc.message}", rule=exc.rule,
                              tensor=exc.tensor, path=str(ranks[(t, p)])) from None
        for k in skipped:
            if not k.endswith("_extra_state"):
                out.notes.append(f"{k}: not a tensor; left out")
        aliases.update(rank_aliases)
        for spec in rank_specs:
            known = specs.setdefault(spec.path, spec)
            if known != spec:
                raise LayoutError(f"ranks disagree: {known.to_json()} vs {spec.to_json()}",
                                  rule="UCP-1.0-R131", tensor=spec.path)
        for frag in frags:
            pieces.setdefault(frag.path, []).append((frag.box, frag.data))
    for p_, spec in specs.items():
        _check_covered(p_, spec.shape, [b for b, _ in pieces.get(p_, [])])
        out.tensors.append(TensorSource(
            p_, tuple(spec.shape), dtypes.by_name(spec.dtype), _assemble(p_, spec, pieces[p_]),
            spec.attributes,
        ))
    if aliases:
        out.groups.setdefault("model", {})["aliases"] = aliases
    out.notes.append(note_opt)
    training = out.group_values("training")
    if isinstance(first.get("iteration"), int):
        training["step"] = first["iteration"]
    out.metadata["source"] = {
        "format": FORMAT,
        "iteration": it_dir.name,
        "tp": tp,
        "pp": pp,
        "checkpoint_version": plain(first.get("checkpoint_version")),
        "rules": rule_set.name,
        "rule_params": {k: v for k, v in params.items() if is_json_value(v)},
        "args": {k: v for k, v in args.items() if is_json_value(v)},
    }
    return out


def _check_covered(path: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    from ucpformat.distributed import check_coverage

    check_coverage(path, shape, boxes)


def _assemble(
    path: str, spec: Any, parts: list[tuple[Box, np.ndarray[Any, Any]]]
) -> Callable[[], np.ndarray[Any, Any]]:
    """Copy each rank's piece into the consolidated tensor (replicas: the first one)."""

    def read() -> np.ndarray[Any, Any]:
        shape = tuple(spec.shape)
        if len(parts) == 1 and parts[0][0] == full_box(shape):
            return np.array(parts[0][1].reshape(shape), copy=True)
        out = np.empty(shape, dtype=dtypes.by_name(spec.dtype).numpy)
        done: list[Box] = []
        for box, data in parts:
            if any(contains(b, box) for b in done):
                continue
            out[as_slices(box)] = np.asarray(data).reshape(box_shape(box))
            done.append(box)
        return out

    return read


__all__ = ["FORMAT", "detect", "iteration_dir", "rule_params_from_args", "scan"]
