"""A Hugging Face ``Trainer`` checkpoint directory -> UCP: the whole training state.

A ``checkpoint-<step>/`` directory of the stock ``transformers.Trainer`` becomes the
checkpoint :class:`ucpformat.trainers.transformers.UCPTrainer` itself writes, under the
same names, so that ``UCPTrainer.train(resume_from_checkpoint=<converted>)`` goes on
bit for bit:

* ``model.safetensors`` (or its shards) -> ``model/<fqn>`` (tied weights as aliases);
* ``optimizer.pt`` -> ``optimizer/`` by parameter name;
* ``scheduler.pt`` -> ``training/scheduler``, ``trainer_state.json`` ->
  ``training/trainer_state`` and ``training/step``;
* ``rng_state.pth`` / ``rng_state_<rank>.pth`` -> each rank's generators
  (:func:`ucpformat.trainers.common.rank_rng_extra`).

``optimizer.pt`` numbers the parameters. The names come from the model that
``config.json`` describes: its ``architectures`` class from transformers is built on
the meta device (no memory, no weights), and the parameters are ordered as the installed
transformers' ``Trainer.create_optimizer`` orders them (``named_parameters()``, split
into the weight-decay group and the no-decay group by ``get_decay_parameter_names``).
Every count and shape is checked against ``optimizer.pt`` and the weights; a checkpoint
that does not fit (a custom optimizer, frozen parameters, another model) is refused,
naming the file and why. The ``.pt``/``.pth`` files are pickles: they are read only with
``allow_pickle=True`` (``--allow-pickle``), and then with ``torch.load(weights_only=True)``.
``training_args.bin`` (a pickle of the ``TrainingArguments``) is left out, with a note:
``UCPTrainer`` stores none either (the resuming run's arguments are used).
``weights_only=True`` converts the weights alone (the safetensors importer).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from ucpformat.errors import FormatError
from ucpformat.importers import safetensors as st
from ucpformat.importers._engine import Scan, TensorSource, model_attributes, node
from ucpformat.importers._torch import is_tensor, load_restricted, tensor_reader
from ucpformat.interchange import data_type_of

FORMAT: Final = "hf-trainer"
TRAINER_STATE: Final = "trainer_state.json"
OPTIMIZER: Final = "optimizer.pt"
SCHEDULER: Final = "scheduler.pt"
CONFIG: Final = "config.json"
#: Left behind, with a note: UCPTrainer does not store them either.
NOT_STORED: Final = ("training_args.bin",)
_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")


def detect(path: Path) -> bool:
    """A directory with ``trainer_state.json`` beside safetensors weights."""
    return path.is_dir() and (path / TRAINER_STATE).is_file() and st.detect(path)


def _fail(msg: str, path: Path, tensor: str | None = None) -> FormatError:
    return FormatError(msg, path=str(path), tensor=tensor)


def _rng_files(path: Path) -> dict[int, Path]:
    """Rank -> its ``rng_state_<rank>.pth`` (``rng_state.pth``: the one process's)."""
    single = path / "rng_state.pth"
    ranks = {int(m.group(1)): p for p in sorted(path.iterdir())
             if (m := _RNG_FILE.fullmatch(p.name)) and p.is_file()}
    if single.is_file():
        if ranks:
            raise _fail("both rng_state.pth and rng_state_<rank>.pth: which run's is it?", path)
        return {0: single}
    if sorted(ranks) != list(range(len(ranks))):
        raise _fail(f"rng_state_<rank>.pth for ranks {sorted(ranks)}: some ranks are missing",
                    path)
    return ranks


def _build_model(path: Path) -> Any:
    """The model ``config.json`` describes, on the meta device."""
    from ucpformat.optional import require

    transformers = require("transformers", extra="transformers",
                           purpose="converting a Hugging Face Trainer checkpoint")
    import torch

    cfg_path = path / CONFIG
    if not cfg_path.is_file():
        raise _fail(f"no {CONFIG}: {OPTIMIZER} numbers the parameters, and their names come "
                    f"from the model {CONFIG} describes (a model that is not a transformers "
                    "PreTrainedModel cannot be named; convert with weights_only=True "
                    "(--weights-only), or save the whole state with UCPTrainer)", path)
    try:
        doc = json.loads(cfg_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise _fail(f"not JSON: {exc}", cfg_path) from None
    archs = doc.get("architectures") if isinstance(doc, dict) else None
    if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
        raise _fail(f"'architectures' must name one model class, not {archs!r}", cfg_path)
    cls: Any = getattr(transformers, archs[0], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise _fail(f"unknown architecture {archs[0]!r}: not a model class of transformers "
                    f"{transformers.__version__} (remote code is never run)", cfg_path)
    try:
        config = transformers.AutoConfig.from_pretrained(str(path))
        with torch.device("meta"):
            return cls(config)
    except Exception as exc:  # transformers' own refusal of the config
        raise _fail(f"cannot build {archs[0]} from it: {type(exc).__name__}: {exc}",
                    cfg_path) from None


def _optimizer_names(model: Any, opt: Any, file: Path) -> dict[int, str]:
    """Parameter id -> name, as ``Trainer.create_optimizer`` groups the parameters."""
    from transformers import Trainer, __version__

    if not (isinstance(opt, Mapping) and isinstance(opt.get("state"), Mapping)
            and isinstance(opt.get("param_groups"), list)
            and all(isinstance(g, Mapping) and isinstance(g.get("params"), list)
                    for g in opt["param_groups"])):
        raise _fail("not a torch.optim state dict (state, param_groups)", file)
    decay = set(Trainer.get_decay_parameter_names(None, model))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    expected = [[n for n in trainable if n in decay], [n for n in trainable if n not in decay]]
    groups = opt["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    if sizes != [len(e) for e in expected]:
        raise _fail(
            f"{len(groups)} param groups of {sizes} parameters; transformers {__version__}'s "
            f"Trainer.create_optimizer builds 2 of {[len(e) for e in expected]} for a "
            f"{type(model).__name__} (weight decay, none): a custom optimizer or frozen "
            "parameters, whose numbers cannot be named exactly (save with UCPTrainer, or "
            "convert with weights_only=True)", file)
    by_id: dict[int, str] = {}
    for g, names in zip(groups, expected, strict=True):
        if "param_names" in g and [str(n) for n in g["param_names"]] != names:
            raise _fail(f"param_names {g['param_names']} differ from the Trainer's order "
                        f"{names}", file)
        for i, name in zip(g["params"], names, strict=True):
            by_id[int(i)] = name
    if len(by_id) != sum(sizes):
        raise _fail("a parameter id is in two param groups", file)
    return by_id


def _add_optimizer(out: Scan, model: Any, file: Path) -> None:
    from ucpformat.torch.state import to_json

    opt = load_restricted(file, mmap=True, stand_ins={})
    by_id = _optimizer_names(model, opt, file)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for i, entries in opt["state"].items():
        name = by_id.get(int(i))
        if name is None:
            raise _fail(f"state for parameter {i}, which no param group lists", file)
        if not isinstance(entries, Mapping):
            raise _fail(f"the state of parameter {i} ({name}) is not a mapping", file)
        group = node("optimizer", "state", name)
        out.groups.setdefault(group, {})
        for key, value in entries.items():
            where = f"optimizer/state/{name}/{key}"
            if is_tensor(value):
                if value.ndim and tuple(value.shape) != shapes[name]:
                    raise _fail(f"{OPTIMIZER}'s parameter {i} is {name} in the Trainer's order, "
                                f"of shape {list(shapes[name])}, but its {key!r} has shape "
                                f"{list(value.shape)}: not this model's optimizer", file, where)
                out.tensors.append(TensorSource(
                    node("optimizer", "state", name, str(key)), tuple(value.shape),
                    data_type_of(value.dtype, tensor=where), tensor_reader(value, where,
                                                                           mapped=True),
                    {"ucp": {"role": "optimizer_state"}}))
            else:
                out.group_values(group)[str(key)] = to_json(value, where=where)
    param_groups = []
    for gi, g in enumerate(opt["param_groups"]):
        doc = {k: to_json(v, where=f"optimizer/param_groups[{gi}].{k}")
               for k, v in g.items() if k != "params"}
        doc["params"] = [by_id[int(i)] for i in g["params"]]
        param_groups.append(doc)
    out.group_values("optimizer")["param_groups"] = param_groups


def _check_model(out: Scan, model: Any, path: Path) -> None:
    """The weights against the model's state dict: names and shapes; tied weights become
    aliases and every tensor's role is the model's (parameter or buffer)."""
    from ucpformat.torch.state import tied_aliases

    sd = model.state_dict()
    aliases = tied_aliases(model, list(sd))
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    found = {t.path: t for t in out.tensors if t.path.startswith("model/")}
    kept: list[TensorSource] = []
    for fqn, value in sd.items():
        where = node("model", fqn)
        source = found.pop(where, None)
        if fqn in aliases:  # tied: stored once, under its first name
            if source is not None:
                out.notes.append(f"{fqn}: stored once, as an alias of {aliases[fqn]} (tied in "
                                 "the model; the weights file holds both)")
            continue
        if source is None:
            raise _fail("the model config.json describes has this tensor; the weights do not",
                        path, where)
        if source.shape != tuple(value.shape):
            raise _fail(f"shape {list(source.shape)} in the weights, {list(value.shape)} in the "
                        "model config.json describes", path, where)
        role = "parameter" if fqn in params else "buffer"
        layout = source.attributes.get("ucp", {}).get("layout")
        kept.append(dataclasses.replace(source, attributes=model_attributes(role, layout)))
    if found:
        raise _fail(f"tensors that the model config.json describes does not have: "
                    f"{sorted(found)[:5]}", path, next(iter(sorted(found))))
    out.tensors = kept + [t for t in out.tensors if not t.path.startswith("model/")]
    out.groups.setdefault("model", {}).pop("aliases", None)
    if aliases:
        out.groups["model"]["aliases"] = aliases


def _training(out: Scan, path: Path, files: dict[str, Path], rng: dict[int, Path]) -> None:
    """``training/``: the step, the scheduler, the trainer state and each rank's generators,
    through the same collection as a save of UCPTrainer."""
    from transformers import TrainerState

    from ucpformat.torch.distributed import collect_state
    from ucpformat.trainers.common import encode_state, rank_rng_extra, rng_state

    state_file = path / TRAINER_STATE
    try:
        doc = json.loads(state_file.read_text(encoding="utf-8"))
        state = TrainerState(**doc)
    except (ValueError, TypeError) as exc:
        raise _fail(f"not a TrainerState: {exc}", state_file) from None
    extra: dict[str, Any] = {"trainer_state": encode_state(
        dataclasses.asdict(state), where="training/trainer_state")}
    scheduler = None
    if SCHEDULER in files:
        scheduler = _Loaded(load_restricted(files[SCHEDULER], mmap=False, stand_ins={}))
    ranks = {}
    for rank, file in rng.items():
        loaded = load_restricted(file, mmap=False, stand_ins={})
        if not isinstance(loaded, Mapping):
            raise _fail("not a mapping of generator states", file)
        other = sorted(set(loaded) - {"python", "numpy", "cpu", "cuda"})
        if other:
            raise _fail(f"generator states of {other}, which UCPTrainer does not store", file)
        missing = sorted({"python", "numpy", "cpu"} - set(loaded))
        if missing:
            raise _fail(f"no generator state of {missing}", file)
        cuda = loaded.get("cuda", [])
        cuda = [cuda] if is_tensor(cuda) else list(cuda)
        ranks[str(rank)] = rng_state(loaded["python"], loaded["numpy"], loaded["cpu"], cuda,
                                     where=str(file))
    if ranks:
        extra.update(rank_rng_extra(ranks))
    collected = collect_state(scheduler=scheduler, step=int(state.global_step), extra=extra)
    for item in collected.items:
        t = item.tensor
        out.tensors.append(TensorSource(item.path, tuple(t.shape),
                                        data_type_of(t.dtype, tensor=item.path),
                                        tensor_reader(t, item.path), {"ucp": {"role": item.role}}))
    for group, ucp in collected.groups.items():
        target = out.groups.setdefault(group, {})
        for key, value in ucp.items():
            if key == "values":
                target.setdefault("values", {}).update(value)
            else:
                target[key] = value


class _Loaded:
    """A loaded ``state_dict()`` in the shape of its object (what a save collects)."""

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> Any:
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


def scan(
    path: Path,
    *,
    allow_pickle: bool = False,
    weights_only: bool = False,
    rules: Any = None,
    rule_params: Mapping[str, Any] | None = None,
) -> Scan:
    """The whole training state of a Trainer checkpoint directory (see the module)."""
    if weights_only:
        return st.scan(path, weights_only=True, rules=rules, rule_params=rule_params)
    state_files = st.training_state_files(path)
    rng = _rng_files(path)
    files = {name: path / name for name in (OPTIMIZER, SCHEDULER) if (path / name).is_file()}
    understood = {TRAINER_STATE, *files, *(p.name for p in rng.values()), *NOT_STORED}
    unknown = [name for name in state_files if name not in understood]
    if unknown:
        raise _fail(f"training state this importer does not convert: {', '.join(unknown)} "
                    "(UCPTrainer stores no such state; convert with weights_only=True "
                    "(--weights-only) to leave it behind)", path)
    if files or rng:
        missing = [n for n in (OPTIMIZER, SCHEDULER) if n not in files]
        if not rng:
            missing.append("rng_state.pth")
        if missing:
            raise _fail(f"a Trainer checkpoint with part of its training state: "
                        f"{', '.join(missing)} missing", path)
    pickles = [*files.values(), *rng.values()]
    if pickles and not allow_pickle:
        raise _fail(
            f"{', '.join(p.name for p in pickles)} are pickles (torch.save): converting them "
            "needs allow_pickle=True (ucp convert --allow-pickle), only for a checkpoint you "
            "trust (they are read with torch.load(weights_only=True)); or convert the weights "
            "alone with weights_only=True (--weights-only)", path)
    out = st.scan(path, weights_only=True, rules=rules, rule_params=rule_params)
    out.format = FORMAT
    out.notes[:] = [n for n in out.notes if not n.startswith("weights only:")]
    left = [n for n in state_files if n in NOT_STORED]
    if left:
        out.notes.append(f"not converted: {', '.join(left)} (a pickle of the "
                         "TrainingArguments; UCPTrainer stores none: the resuming run's "
                         "arguments are used)")
    converted = sorted((understood - set(NOT_STORED)) & set(state_files))
    out.metadata["source"] = {**out.metadata.get("source", {}), "format": FORMAT,
                              "training_state": converted}
    if OPTIMIZER in files or (path / CONFIG).is_file():
        model = _build_model(path)
        _check_model(out, model, path)
        if OPTIMIZER in files:
            _add_optimizer(out, model, files[OPTIMIZER])
    _training(out, path, files, rng)
    return out


__all__ = ["FORMAT", "detect", "scan"]
