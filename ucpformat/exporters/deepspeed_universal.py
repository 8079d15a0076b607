"""UCP -> DeepSpeed's universal checkpoint layout, which ``load_universal`` resumes from.

The layout ``ds_to_universal`` writes, for any number of ranks::

    DEST/latest_universal                     the tag
    DEST/<tag>/zero/<param>/fp32.pt            {"param": fp32 master weights, "cat_dim": d}
    DEST/<tag>/zero/<param>/exp_avg.pt         {"param": ..., "cat_dim": d}  (every state
    DEST/<tag>/zero/<param>/exp_avg_sq.pt       of the parameter's shape)
    DEST/<tag>/zero/<param>/step.pt            the step, a 0-d tensor
    DEST/<tag>/zero/optimizer_state.pt         hyperparameters (param_groups), step, version
    DEST/<tag>/mp_rank_00_model_states.pt      module weights, shapes, steps (ZeRO 0-2)
    DEST/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, for ZeRO-3 loaders

A DeepSpeed run resumes from it with ``"checkpoint": {"load_universal": true}`` and
``engine.load_checkpoint(DEST)`` at any data-parallel size and ZeRO stage. The fp32
master weights are ``optimizer/state/<p>/master`` when the checkpoint has them (mixed
precision), else ``model/<p>`` cast to fp32. ``cat_dim`` is the tensor-parallel
dimension of the parameter's layout semantics (0 when replicated); a vocabulary
dimension sets ``vocab_tensor``; equal fused parts set ``param_n_sub_params``.
Every file is written with ``torch.save`` one tensor at a time (the model states file
streaming, like the ``torch`` exporter), so memory stays bounded.
"""

from __future__ import annotations

import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from ucpformat.checkpoint.reader import Checkpoint, Tensor
from ucpformat.errors import InvalidValueError
from ucpformat.exporters import ExportResult
from ucpformat.exporters._common import atomic_dir, model_tensors, optimizer_states
from ucpformat.exporters.torch_save import TorchFile
from ucpformat.interchange import DEFAULT_MEMORY_LIMIT, bounded_map, from_numpy, torch_module
from ucpformat.layout.semantics import layout_of

FORMAT: Final = "deepspeed-universal"
DS_VERSION: Final = "0.19.8"  # the DeepSpeed release whose layout this writes


def _param_meta(t: Tensor) -> dict[str, Any]:
    """``cat_dim`` and friends from the parameter's layout semantics."""
    meta: dict[str, Any] = {"cat_dim": 0}
    layout = layout_of(t.attributes, t.shape, tensor=t.path)
    if layout.tp_dim is not None:
        meta["cat_dim"] = layout.tp_dim
    if layout.vocab_dim is not None:
        meta["vocab_tensor"] = True
    if layout.parts and len({p.size for p in layout.parts}) == 1 and layout.groups is None:
        meta["param_n_sub_params"] = len(layout.parts)
    return meta


def export(
    ckpt: Checkpoint,
    destination: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    workers: int | None = None,
    memory_limit: int | None = None,
    progress: bool | Callable[[int], None] = False,
    tag: str | None = None,
    ds_version: str | None = None,
) -> ExportResult:
    """Write ``ckpt`` as a DeepSpeed universal checkpoint directory."""
    torch = torch_module()
    dest = Path(destination)
    source = ckpt.metadata.get("source", {})
    source = source if isinstance(source, Mapping) else {}
    training = ckpt.values("training") if "training" in ckpt.groups else {}
    step = int(training.get("step", ckpt.values("").get("step", 0)) or 0)
    tag = tag or f"global_step{step}"
    if not tag or "/" in tag or tag in (".", ".."):
        raise InvalidValueError(f"bad tag {tag!r}")
    version = ds_version or str(source.get("ds_version") or DS_VERSION)
    model = model_tensors(ckpt)
    states = optimizer_states(ckpt)
    opt_values = ckpt.values("optimizer") if "optimizer" in ckpt.groups else {}
    groups_doc = opt_values.get("param_groups")
    if not isinstance(groups_doc, list) or not groups_doc:
        groups_doc = [{"params": [n for n, t in model if t.attributes.get("role") != "buffer"
                                  and t.meta.dtype.kind == "float"]}]
    trained = [str(p) for g in groups_doc for p in g.get("params", [])]
    by_name = dict(model)
    for pname in by_name:
        if "/" in pname or pname in (".", "..") or "\x00" in pname:
            raise InvalidValueError("cannot be a directory name under zero/", tensor=pname)
    missing = [p for p in trained if p not in by_name]
    if missing:
        raise InvalidValueError(f"param_groups name parameters the model lacks: {missing[:5]}",
                                path=ckpt.location)
    notes: list[str] = []

    # (file path relative to the tag, tensor, dict extras, dtype conversion)
    jobs: list[tuple[str, Tensor, dict[str, Any], bool]] = []
    steps: dict[str, Any] = {}
    for pname in trained:
        param = by_name[pname]
        pstates = states.get(pname, {})
        meta = _param_meta(param)
        base = f"zero/{pname}"
        master = pstates.get("master")
        if master is not None:
            jobs.append((f"{base}/fp32.pt", master, meta, True))
        else:
            jobs.append((f"{base}/fp32.pt", param, meta, True))
        for sname, t in sorted(pstates.items()):
            if sname in ("master", "step"):
                continue
            if t.shape != param.shape:
                notes.append(f"{pname}: state {sname!r} of shape {list(t.shape)} left out (the "
                             "universal layout holds states of the parameter's shape)")
                continue
            jobs.append((f"{base}/{sname}.pt", t, meta, True))
        if "step" in pstates:
            steps[pname] = pstates["step"]
    for sname_check in ("exp_avg", "exp_avg_sq"):
        if trained and not any(sname_check in states.get(p, {}) for p in trained):
            notes.append(f"no {sname_check} in the checkpoint: DeepSpeed will start its "
                         "optimizer moments from zero")

    total = 0
    written: list[str] = []
    with atomic_dir(dest, overwrite=overwrite) as tmp:
        root = tmp / tag
        (root / "zero").mkdir(parents=True)

        def save(item: tuple[str, Tensor, dict[str, Any], bool]) -> tuple[str, int]:
            rel, t, extras, as_fp32 = item
            data = t.read()
            tensor = from_numpy(data, name=t.path)
            if as_fp32 and tensor.dtype != torch.float32:
                tensor = tensor.to(torch.float32)
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"param": tensor, **extras}, target)
            return rel, data.nbytes

        for rel, nbytes in _run(save, jobs, workers, memory_limit, progress):
            written.append(rel)
            total += nbytes
        # step, per parameter and in the optimizer state (ZeRO-3 reads it there)
        default_step = torch.tensor(float(step))
        first_step = default_step
        for pname in trained:
            st = steps.get(pname)
            value = from_numpy(st.read(), name=st.path).clone() if st is not None else default_step
            if st is not None and first_step is default_step:
                first_step = value
            torch.save(value, root / "zero" / pname / "step.pt")
        hyper = []
        for i, g in enumerate(groups_doc):
            doc = {k: v for k, v in g.items() if k != "params"}
            doc["params"] = [i]
            hyper.append(doc)
        torch.save({
            "param_groups": hyper,
            "ds_version": version,
            "optimizer_state_dict": {"state": {0: {"step": first_step}}, "param_groups": hyper},
        }, root / "zero" / "optimizer_state.pt")

        # model states: the module's tensors stream in; the rest is small
        tf = TorchFile()
        module = OrderedDict((n, tf.ref(t)) for n, t in model)
        model_group = ckpt.groups.get("model")
        aliases = dict(model_group.ucp.get("aliases", {})) if model_group is not None else {}
        shapes = [OrderedDict((str(p), torch.Size(by_name[str(p)].shape))
                              for p in g.get("params", [])) for g in groups_doc]
        dp = int(source.get("dp_world_size") or 1)
        cfg = source.get("ds_config") if isinstance(source.get("ds_config"), Mapping) else {}
        structure: dict[str, Any] = {
            "module": module,
            "buffer_names": [n for n, t in model if t.attributes.get("role") == "buffer"],
            "optimizer": None,
            "param_shapes": shapes,
            "frozen_param_shapes": OrderedDict(),
            "shared_params": aliases,
            "frozen_param_fragments": OrderedDict(),
            "lr_scheduler": training.get("lr_scheduler"),
            "data_sampler": None,
            "random_ltd": None,
            "sparse_tensor_module_names": set(),
            "skipped_steps": int(training.get("skipped_steps", 0) or 0),
            "global_steps": step,
            "global_samples": int(training.get("global_samples", 0) or 0),
            "dp_world_size": dp,
            "mp_world_size": 1,
            "ds_config": dict(cfg or {}),
            "ds_version": version,
        }
        states_file = root / "mp_rank_00_model_states.pt"
        tf.write(states_file, structure, workers=workers, memory_limit=memory_limit)
        shutil.copyfile(states_file, root / "zero_pp_rank_0_mp_rank_00_model_states.pt")
        (tmp / "latest_universal").write_text(tag, encoding="utf-8")
        written += [f"{tag}/mp_rank_00_model_states.pt",
                    f"{tag}/zero_pp_rank_0_mp_rank_00_model_states.pt",
                    f"{tag}/zero/optimizer_state.pt", "latest_universal"]
    return ExportResult(ckpt.location, str(dest), FORMAT, len(jobs), total + tf.nbytes,
                        tuple(written), notes=tuple(notes))


def _run(
    fn: Callable[[Any], tuple[str, int]],
    jobs: list[Any],
    workers: int | None,
    memory_limit: int | None,
    progress: bool | Callable[[int], None],
) -> Iterator[tuple[str, int]]:
    """``fn`` over the jobs on threads, bounded memory (each job holds one tensor)."""
    from ucpformat.checkpoint.write_loop import default_workers
    from ucpformat.progress import byte_progress

    total = sum(job[1].nbytes for job in jobs)
    with byte_progress(progress, total, "writing zero/") as advance:
        for rel, nbytes in bounded_map(
            fn, jobs, lambda job: 2 * job[1].nbytes,
            workers=workers or default_workers(),
            memory_limit=memory_limit or DEFAULT_MEMORY_LIMIT,
        ):
            advance(nbytes)
            yield rel, nbytes


__all__ = ["DS_VERSION", "FORMAT", "export"]
