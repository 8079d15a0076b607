"""Real DeepSpeed 0.19.8 engines on gloo for the tests of ``ucpformat.deepspeed``.

``python -m tests.deepspeed.harness OUT`` imports DeepSpeed once and forks every run from
that process (``ucpformat.torch.launch.spawn(start_method="fork")``): DeepSpeed's engines
import torch's compiler stack, 13 s of CPU per process, which the forked ranks share.
The runs, in order:

1. ``demo``: :func:`ucpformat.deepspeed.demo.run_demo` at its quick size (ZeRO-2 on 4
   processes saves half-way; ZeRO-3 on 2 and no ZeRO on 1 resume; a control without
   the optimizer state);
2. ``save`` (4 ranks): the matrix net (:class:`DsNet`: flat partitions cut through its
   parameters; a buffer; a WarmupLR schedule) under ZeRO-1/2/3 x fp32/bf16, and ZeRO-2
   fp16 (its loss scaler; DeepSpeed refuses fp16 on a CPU, whose accelerator check
   this harness overrides: torch's CPU kernels run it), each trained 3 steps and saved
   by ``ucpformat.deepspeed.save`` and by ``engine.save_checkpoint``; the checkpoint
   engine plug-in; an asynchronous save; a net with a frozen layer and a tied head; a
   Megatron-DeepSpeed-style GPT on 2 pipeline stages x 2 tensor-parallel ranks (rule
   file ``megatron-deepspeed-gpt``) and a pipeline net on 2 stages x 2 data-parallel
   ranks (DeepSpeed's bf16 optimizer); a save a rank fails in, over a committed one;
3. ``prepare`` (1 rank): DeepSpeed's ``ds_to_universal`` of each matrix run, repaired
   where DeepSpeed's own loaders cannot read its output (:func:`repair_universal`),
   ``ucp convert`` of one run, and a checkpoint of the single-process torch API;
4. ``resume`` on 2, 3 and 1 ranks: every load of :data:`LOADS` into a fresh engine,
   compared bit for bit with DeepSpeed's own ``load_universal`` of the same run (flat
   partitions, every state, 16-bit weights, hyperparameters, scheduler, counters, loss
   scaler), then both trained on; re-saved; the pipeline and tensor-parallel runs at
   other degrees; checkpoints of other paths; refusals (the engine unchanged);
5. ``crash`` (2 ranks): a save with a tag, then rank 1 dies while writing the next
   tag's shards.

What each check found goes to ``OUT/results.json`` (``checks``: name -> problems, empty
when it passed; ``losses``; ``demo``). The pytest side (``tests/deepspeed/``) asserts it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.importers.ds_pipeline import _TP, GPT, _config, gpt_pipe, pipe_net
from tests.importers.frameworks import DsNet, ds_config

#: the matrix: every run saved on 4 ranks
SOURCES = [f"zero{s}-{d}" for s in (1, 2, 3) for d in ("fp32", "bf16")] + ["zero2-fp16"]
#: (source, world, ZeRO stage, data type) of each load: every source on 2 and 3 ranks, each
#: time under another ZeRO stage, and on 1 rank; then precision changes, fp16, no ZeRO
LOADS = [
    (src, world, (int(src[4]) + shift) % 3 + 1, src.split("-")[1])
    for src in SOURCES if src != "zero2-fp16" for world, shift in ((2, 0), (3, 1), (1, 1))
] + [
    ("zero1-fp32", 2, 2, "bf16"), ("zero3-bf16", 3, 2, "fp32"), ("zero2-fp16", 2, 1, "fp16"),
    ("zero2-fp32", 1, 0, "fp32"), ("zero1-bf16", 1, 0, "bf16"),
]
#: the rule parameters of the GPT of tests/importers/ds_pipeline.py
GPT_RULE_PARAMS = {k: GPT[k] for k in ("num_attention_heads", "num_query_groups", "kv_channels",
                                       "ffn_hidden_size", "vocab_size")} | {
    "gated_linear_unit": True}
GPT_RULES = {"rules": "megatron-deepspeed-gpt", "rule_params": GPT_RULE_PARAMS}
#: (pipeline stages, tensor-parallel ranks) the GPT resumes at, by world size
GPT_RESUMES = {2: [(1, 2), (2, 1)], 1: [(1, 1)]}
#: DeepSpeed AutoTP: a small Llama at tensor-parallel 2 x data-parallel 2 on 4 ranks, no
#: rule file (the engine's universal_checkpoint_info); (TP degree, ZeRO stage) of each
#: resume, by world size. Before the GPT's and TP 1 first: DeepSpeed keeps the last
#: model-parallel unit in deepspeed.utils.groups.mpu, and a later engine without one of
#: its own fails to initialize where that unit's model-parallel size is above 1
AUTOTP = "autotp2-zero1-fp32"
AUTOTP_RESUMES = {2: [(1, 3), (2, 2)], 1: [(1, 0)]}
#: the batches the uninterrupted and the resumed AutoTP runs train on after the save
AUTOTP_AFTER = [50, 51]
STEPS = 3
#: each forked run's limit: they take 5 to 30 s; a rank stuck in a collective after a
#: peer raised is then reported in minutes, not after gloo's 30 minutes
STAGE_TIMEOUT_S = 420


def load_name(src: str, world: int, stage: int, dtype: str) -> str:
    return f"{src}->w{world}-zero{stage}-{dtype}"


# -- the models ----------------------------------------------------------------------------


class FrozenNet(nn.Module):
    """A frozen layer, a head tied to the embedding, a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 12)
        self.fc1 = nn.Linear(12, 29)
        self.proj = nn.Linear(29, 12)
        self.proj.requires_grad_(False)
        self.head = nn.Linear(12, 37, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("running", torch.linspace(0, 1, 5))

    def forward(self, x: Any) -> Any:
        return self.head(self.proj(torch.relu(self.fc1(self.emb(x)))))


class WideNet(DsNet):
    """DsNet with one parameter of another shape: fc1 has 30 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, 30)
        self.fc2 = nn.Linear(30, 7)


class ExtraNet(DsNet):
    """DsNet with a parameter the checkpoints do not have."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(7, 7)

    def forward(self, x: Any) -> Any:
        return self.extra(super().forward(x))


class LargeNet(nn.Module):
    """Tensors large enough (64 KiB and more) that what a load reads is mostly data."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 256)
        self.fc = nn.Linear(256, 256)
        self.head = nn.Linear(256, 37)

    def forward(self, x: Any) -> Any:
        return self.head(torch.relu(self.fc(self.emb(x))))


MODELS: dict[str, Callable[[], nn.Module]] = {"dsnet": DsNet, "frozen": FrozenNet,
                                             "wide": WideNet, "extra": ExtraNet,
                                             "large": LargeNet}
#: the run whose loads' read volumes are measured, and (world, ZeRO stage) of each load
READ_VOLUME = ("large-zero2-fp32", {2: 1, 3: 3})


def config(stage: int, dtype: str, *, universal: bool = False) -> dict[str, Any]:
    cfg = ds_config(stage, "bf16" if dtype == "bf16" else "fp32")
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def make_engine(model: str, stage: int, dtype: str, *, seed: int = 0,
                universal: bool = False) -> Any:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if dtype == "fp16":  # DeepSpeed's CPU accelerator refuses it; torch's kernels run it
        get_accelerator().is_fp16_supported = lambda: True
    torch.manual_seed(seed)
    net = MODELS[model]()
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=config(stage, dtype, universal=universal))
    return engine


def train(engine: Any, rank: int, steps: int, start: int = 0) -> list[float]:
    losses = []
    for step in range(start, start + steps):
        torch.manual_seed(10 * step + rank)
        x = torch.randint(0, 37, (2, 5))
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


# -- what an engine holds, and comparisons ------------------------------------------------------


def snapshot(engine: Any) -> dict[str, Any]:
    """Everything a resumed engine must equal: flat partitions (padding included), every
    state, the 16-bit weights, hyperparameters, scheduler, counters, loss scaler."""
    from ucpformat.deepspeed.rank_fragments import holdings, inner_optimizer
    from ucpformat.deepspeed.save import loss_scaler
    from ucpformat.torch.state import to_json

    h = holdings(engine)
    inner = inner_optimizer(engine)
    out: dict[str, Any] = {}
    for i, flat in enumerate(h.flats):
        out[f"flat{i}/master"] = flat.master.detach().clone()
        for key, value in (inner.state.get(flat.master, {}) if inner is not None else {}).items():
            out[f"flat{i}/{key}"] = value.detach().clone() if torch.is_tensor(value) else value
    for name, p in engine.module.named_parameters():
        out[f"module/{name}"] = (p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().clone()
    for name, b in engine.module.named_buffers():
        out[f"buffer/{name}"] = b.detach().clone()
    if inner is not None:
        out["param_groups"] = to_json([{k: v for k, v in g.items() if k != "params"}
                                       for g in inner.param_groups], where="param_groups")
    if engine.lr_scheduler is not None:
        out["scheduler"] = engine.lr_scheduler.state_dict()
    out["counters"] = [engine.global_steps, engine.global_samples, engine.skipped_steps]
    opt = engine.optimizer
    out["clip_grad"] = getattr(opt, "clip_grad", None)
    scaler = loss_scaler(opt)
    if scaler is not None:
        out["loss_scaler"] = {k: v for k, v in vars(scaler).items()
                              if isinstance(v, bool | int | float)}
    return out


def differences(a: Mapping[str, Any], b: Mapping[str, Any],
                skip: tuple[str, ...] = ()) -> list[str]:
    """Keys whose values differ (tensors bit for bit)."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key.startswith(skip):
            continue
        x, y = a.get(key), b.get(key)
        if torch.is_tensor(x) and torch.is_tensor(y):
            same = (x.shape == y.shape and x.dtype == y.dtype and torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        else:
            same = x == y
        if not same:
            out.append(f"{key}: {_short(x)} != {_short(y)}")
    return out


def _short(value: Any) -> str:
    if torch.is_tensor(value):
        return f"tensor{list(value.shape)} {value.dtype}"
    text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."


class Checks:
    """Problems found per check on this rank (empty list: passed)."""

    def __init__(self) -> None:
        self.found: dict[str, list[str]] = {}
        self.losses: dict[str, list[float]] = {}
        self.bytes_read: dict[str, int] = {}  # "<load> rank<r>": what the rank's load read

    @contextmanager
    def check(self, name: str) -> Iterator[list[str]]:
        problems = self.found.setdefault(name, [])
        try:
            yield problems
        except Exception as exc:
            problems.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}")

    def result(self) -> dict[str, Any]:
        return {"checks": self.found, "losses": self.losses, "bytes_read": self.bytes_read}


def _env(rank: int, world: int) -> None:
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)


# -- 2. the saves ----------------------------------------------------------------------------


def save_job(rank: int, world: int, out: str) -> dict[str, Any]:
    import ucpformat.deepspeed as uds
    from ucpformat.deepspeed import UCPCheckpointEngine

    _env(rank, world)
    checks = Checks()
    root = Path(out)
    for src in SOURCES:
        stage, dtype = int(src[4]), src.split("-")[1]
        with checks.check(f"save {src}"):
            engine = make_engine("dsnet", stage, dtype)
            train(engine, rank, STEPS)
            uds.save(engine, root / "ucp" / src, client_state={"epoch": 7, "note": src,
                                                              "rng": torch.arange(5)})
            engine.save_checkpoint(str(root / "ds" / src), tag="t",
                                   client_state={"epoch": 7, "note": src})
            # the uninterrupted run's next steps, for the resumed runs to follow
            checks.losses[f"{src} rank{rank}"] = train(engine, rank, 2, start=100)
            engine.destroy()
    with checks.check("checkpoint engine plug-in"):
        engine = make_engine("dsnet", 2, "bf16")
        train(engine, rank, STEPS)
        engine.checkpoint_engine = UCPCheckpointEngine(engine)
        engine.save_checkpoint(str(root / "plugin"), client_state={"epoch": 7, "note": "x"})
        uds.save(engine, root / "plugin-direct", client_state={"epoch": 7, "note": "x"})
        engine.destroy()
    with checks.check("asynchronous save"):
        engine = make_engine("dsnet", 3, "bf16")
        train(engine, rank, STEPS)
        future = uds.save(engine, root / "async", tag="step3", async_=True)
        train(engine, rank, 1)  # training goes on while the save writes the snapshot
        future.result()  # type: ignore[union-attr]
        uds.wait()
        engine.destroy()
        engine = make_engine("dsnet", 3, "bf16")  # the same run, saved synchronously
        train(engine, rank, STEPS)
        uds.save(engine, root / "async-sync")
        engine.destroy()
    for src in ("frozen-zero3-bf16", "frozen-zero1-fp32"):
        with checks.check(f"save {src}"):
            engine = make_engine("frozen", int(src.split("zero")[1][0]), src.rsplit("-", 1)[1])
            train(engine, rank, STEPS)
            uds.save(engine, root / "ucp" / src)
            engine.destroy()
    with checks.check(f"save {READ_VOLUME[0]}"):
        engine = make_engine("large", 2, "fp32")
        train(engine, rank, STEPS)
        uds.save(engine, root / "ucp" / READ_VOLUME[0])
        engine.destroy()
    with checks.check("a failed save commits nothing") as problems:
        engine = make_engine("dsnet", 1, "fp32")
        train(engine, rank, STEPS)
        uds.save(engine, root / "replaced")
        uds.save(engine, root / "replaced-copy")
        train(engine, rank, 1)
        _failing_save(engine, rank, root / "replaced", problems)
        engine.destroy()
    _pipeline_saves(rank, root, checks)
    return checks.result()


def _failing_save(engine: Any, rank: int, where: Path, problems: list[str]) -> None:
    """Rank 2 cannot read its values (in the exchange or while writing): every rank
    raises, and the location holds the checkpoint being replaced, unchanged, or one that
    is not committed: never a new or mixed one. A retry then succeeds."""
    import ucpformat.deepspeed as uds
    from ucpformat.deepspeed.save import EngineFragments
    from ucpformat.errors import UCPError

    original = EngineFragments.fragments

    def broken(self: EngineFragments, path: str) -> Any:
        if rank == 2:
            raise OSError("simulated failure reading a fragment")
        return original(self, path)

    EngineFragments.fragments = broken  # type: ignore[method-assign]
    try:
        uds.save(engine, where, overwrite=True)
        problems.append("the save did not fail")
    except UCPError as exc:
        if "rank 2" not in str(exc) and rank != 2:
            problems.append(f"the error does not name rank 2: {exc}")
    finally:
        EngineFragments.fragments = original  # type: ignore[method-assign]
    if rank == 0:
        import ucpformat
        from ucpformat.errors import CheckpointNotFoundError, IncompleteCheckpointError

        try:
            with ucpformat.open(where) as now, ucpformat.open(f"{where}-copy") as old:
                for path in sorted(set(now.keys()) | set(old.keys())):
                    if (path not in now or path not in old
                            or now[path].read().tobytes() != old[path].read().tobytes()):
                        problems.append(f"{path} changed: a failed save was committed")
        except (IncompleteCheckpointError, CheckpointNotFoundError):
            # failed while writing: the old checkpoint was un-committed and the failed
            # save removed what it wrote (UCP-1.0-R049); nothing was committed
            pass
        except Exception as exc:  # recorded, and the retry below still runs on every rank
            problems.append(f"reading the location after the failed save: {exc!r}")
    uds.save(engine, where, overwrite=True)


def _gpt_engine(rank: int, pp: int, tp: int, *, seed: int = 0) -> Any:
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    dp = dist.get_world_size() // (pp * tp)
    topo = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    for ranks in topo.get_axis_comm_lists("model"):  # every rank creates every group
        group = dist.new_group(ranks=ranks)
        if rank in ranks:
            _TP.update(group=group, size=len(ranks), rank=ranks.index(rank))
    torch.manual_seed(seed)
    model = gpt_pipe(topo)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=_config("gpt-zero1-fp32"))
    return engine


def _gpt_step(engine: Any, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)

    def batches() -> Any:
        while True:
            x = torch.randint(0, GPT["vocab_size"], (2, 6), generator=g)
            yield x, x

    return float(engine.train_batch(data_iter=batches()))


def autotp_name(tp: int, stage: int) -> str:
    return f"{AUTOTP}->tp{tp}-zero{stage}"


def _autotp_engine(tp: int, stage: int, *, seed: int = 0, vocab_size: int = 96) -> Any:
    """The Llama of tests/importers/frameworks.py, split by DeepSpeed's AutoTP."""
    import deepspeed

    from tests.importers.frameworks import tiny_llama

    torch.manual_seed(seed)
    model = tiny_llama(vocab_size)
    cfg = ds_config(stage, "fp32")
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    return engine


def _llama_steps(engine: Any, seeds: list[int]) -> list[float]:
    """One step per seed, on the same batch on every rank (AutoTP checks its TP group)."""
    losses = []
    for seed in seeds:
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(seed))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _pipeline_saves(rank: int, root: Path, checks: Checks) -> None:
    import ucpformat.deepspeed as uds

    with checks.check("save gpt-pp2-tp2"):
        engine = _gpt_engine(rank, 2, 2)
        for step in range(2):
            _gpt_step(engine, 5 + step)
        uds.save(engine, root / "ucp" / "gpt-pp2-tp2", **GPT_RULES)
        engine.save_checkpoint(str(root / "ds" / "gpt-pp2-tp2"), tag="t")
        checks.losses[f"gpt-pp2-tp2 rank{rank}"] = [_gpt_step(engine, 50)]
        engine.destroy()
    with checks.check("save pipe-pp2-dp2-bf16"):
        import deepspeed

        torch.manual_seed(0)
        model = pipe_net(2)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            config=_config("pipe-zero0-bf16"))
        g = torch.Generator().manual_seed(5 + engine.grid.data_parallel_id)

        def batches() -> Any:
            while True:
                x = torch.randint(0, 37, (2, 6), generator=g)
                yield x, x

        it = batches()
        for _ in range(2):
            engine.train_batch(data_iter=it)
        uds.save(engine, root / "ucp" / "pipe-pp2-dp2-bf16")
        engine.save_checkpoint(str(root / "ds" / "pipe-pp2-dp2-bf16"), tag="t")
        engine.destroy()
    with checks.check(f"save {AUTOTP}"):
        engine = _autotp_engine(2, 1)
        _llama_steps(engine, [5, 6])
        uds.save(engine, root / "ucp" / AUTOTP)
        engine.save_checkpoint(str(root / "ds" / AUTOTP), tag="t")
        checks.losses[f"{AUTOTP} rank{rank}"] = _llama_steps(engine, AUTOTP_AFTER)
        engine.destroy()


# -- 3. DeepSpeed's own path, and checkpoints of other paths -------------------------------------


def repair_universal(folder: Path, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Make ``ds_to_universal``'s output loadable by DeepSpeed's loaders of every stage.

    DeepSpeed 0.19.8's own chain fails across ZeRO stages: its ZeRO-3 loader looks for
    ``zero_pp_rank_0_mp_rank_00_model_states.pt`` and the step in ``optimizer_state.pt``'s
    ``optimizer_state_dict``, which a ZeRO-1/2 source lacks (KeyError); its ZeRO-1/2
    loader needs ``mp_rank_00_model_states.pt``, ``ds_version`` in
    ``optimizer_state.pt`` ("Empty ds_version in checkpoint"), per-parameter files that
    are ``{"param": tensor}`` dicts of the parameter's shape and a ``step.pt``, where a
    ZeRO-3 source gives bare flat tensors and no step. This adds those files and keys,
    repackaging the values DeepSpeed wrote and changing none. Returns what it did.
    """
    import deepspeed

    done = []
    a = folder / "mp_rank_00_model_states.pt"
    b = folder / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    for have, want in ((a, b), (b, a)):
        if have.exists() and not want.exists():
            shutil.copy(have, want)
            done.append(f"copied {have.name} to {want.name}")
    zero = folder / "zero"
    osd = torch.load(zero / "optimizer_state.pt", weights_only=False)
    if "optimizer_state_dict" not in osd:
        step = torch.load(next(iter(sorted(zero.glob("*/step.pt")))), weights_only=False)
        osd["optimizer_state_dict"] = {"state": {0: {"step": step}},
                                       "param_groups": osd["param_groups"]}
        done.append("added optimizer_state_dict (the step) to optimizer_state.pt")
    if "ds_version" not in osd:
        osd["ds_version"] = deepspeed.__version__
        done.append("added ds_version to optimizer_state.pt")
    torch.save(osd, zero / "optimizer_state.pt")
    step = osd["optimizer_state_dict"]["state"][0]["step"]
    for pdir in sorted(p for p in zero.iterdir() if p.is_dir()):
        if not (pdir / "step.pt").exists():
            torch.save(step, pdir / "step.pt")
            done.append(f"{pdir.name}: added step.pt")
        for f in sorted(pdir.glob("*.pt")):
            value = torch.load(f, weights_only=False)
            if torch.is_tensor(value) and f.stem != "step":
                torch.save({"param": value.view(shapes[pdir.name]), "cat_dim": 0}, f)
                done.append(f"{pdir.name}/{f.name}: wrapped as {{'param': ...}}")
    return done


def prepare_job(rank: int, world: int, out: str) -> dict[str, Any]:
    import argparse as ap

    from deepspeed.checkpoint import ds_to_universal

    import ucpformat
    from ucpformat import importers

    checks = Checks()
    root = Path(out)
    shapes = {n: tuple(p.shape) for n, p in DsNet().named_parameters()}
    repairs: dict[str, list[str]] = {}
    for src in SOURCES:
        with checks.check(f"ds_to_universal {src}"):
            dest = root / "universal" / src / "t"
            ds_to_universal.main(ap.Namespace(
                input_folder=str(root / "ds" / src / "t"), output_folder=str(dest),
                num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                strict=True, inject_missing_state=True, no_strict=False))
            repairs[src] = repair_universal(dest, shapes)
    with checks.check("other paths"):
        importers.convert(root / "ds" / "zero2-bf16", root / "converted-zero2-bf16",
                          durable=False)
        torch.manual_seed(3)
        net = DsNet()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
        for step in range(2):
            torch.manual_seed(step)
            net(torch.randint(0, 37, (2, 5))).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        import ucpformat.torch as ucp_torch

        ucp_torch.save(root / "torch-path", model=net, optimizer=opt, step=2, durable=False)
        ucp_torch.save(root / "model-only", model=net, step=2, durable=False)
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()},
                   root / "torch-path.pt")
        assert ucpformat.validate(root / "torch-path").valid
    return checks.result() | {"repairs": repairs}


# -- 4. the resumes ------------------------------------------------------------------------------


def resume_job(rank: int, world: int, out: str) -> dict[str, Any]:
    import ucpformat.deepspeed as uds

    _env(rank, world)
    checks = Checks()
    root = Path(out)
    for src, w, stage, dtype in LOADS:
        if w != world:
            continue
        name = load_name(src, world, stage, dtype)
        with checks.check(name) as problems:
            ours = make_engine("dsnet", stage, dtype, seed=1234)
            result = uds.load(ours, root / "ucp" / src)
            checks.bytes_read[f"{name} rank{rank}"] = result.bytes_read
            if result.step != STEPS or result.client_state.get("epoch") != 7:
                problems.append(f"step {result.step}, client state {result.client_state}")
            if not torch.equal(result.client_state.get("rng", torch.zeros(1)), torch.arange(5)):
                problems.append(f"client tensor {result.client_state.get('rng')}")
            uds.save(ours, root / "resaved" / name, client_state=result.client_state)
            if stage > 0:  # DeepSpeed's universal loader needs a ZeRO optimizer
                ref = make_engine("dsnet", stage, dtype, seed=1234, universal=True)
                ref.load_checkpoint(str(root / "universal" / src), tag="t")
                problems += differences(snapshot(ours), snapshot(ref))
                mine, theirs = train(ours, rank, 2, start=100), train(ref, rank, 2, start=100)
                if mine != theirs:
                    problems.append(f"trained on: {mine} (ours) != {theirs} (DeepSpeed's)")
                checks.losses[f"{name} rank{rank}"] = mine
                ref.destroy()
            else:
                checks.losses[f"{name} rank{rank}"] = train(ours, rank, 2, start=100)
            ours.destroy()
    for src, stage, dtype in {2: [("frozen-zero3-bf16", 2, "bf16")],
                              3: [("frozen-zero1-fp32", 3, "fp32")]}.get(world, []):
        name = load_name(src, world, stage, dtype)
        with checks.check(name):
            engine = make_engine("frozen", stage, dtype, seed=1234)
            uds.load(engine, root / "ucp" / src)
            uds.save(engine, root / "resaved" / name)
            engine.destroy()
    if world in READ_VOLUME[1]:
        src = READ_VOLUME[0]
        name = load_name(src, world, READ_VOLUME[1][world], "fp32")
        with checks.check(name):
            engine = make_engine("large", READ_VOLUME[1][world], "fp32", seed=1234)
            checks.bytes_read[f"{name} rank{rank}"] = uds.load(engine, root / "ucp" /
                                                              src).bytes_read
            uds.save(engine, root / "resaved" / name)
            engine.destroy()
    for tp, stage in AUTOTP_RESUMES.get(world, []):
        name = autotp_name(tp, stage)
        with checks.check(name):
            engine = _autotp_engine(tp, stage, seed=1234)
            uds.load(engine, root / "ucp" / AUTOTP)
            uds.save(engine, root / "resaved" / name)
            checks.losses[f"{name} rank{rank}"] = _llama_steps(engine, AUTOTP_AFTER)
            engine.destroy()
    if world == 2:
        _uneven_autotp(root, checks)
    for pp, tp in GPT_RESUMES.get(world, []):
        name = f"gpt-pp2-tp2->pp{pp}-tp{tp}"
        with checks.check(name):
            engine = _gpt_engine(rank, pp, tp, seed=1234)
            uds.load(engine, root / "ucp" / "gpt-pp2-tp2", **GPT_RULES)
            uds.save(engine, root / "resaved" / name, **GPT_RULES)
            checks.losses[f"{name} rank{rank}"] = [_gpt_step(engine, 50)]
            engine.destroy()
    if world == 2:
        with checks.check("pipe-pp2-dp2-bf16->pp1-dp2"):
            import deepspeed

            torch.manual_seed(1234)
            model = pipe_net(1)
            engine, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                config=_config("pipe-zero0-bf16"))
            uds.load(engine, root / "ucp" / "pipe-pp2-dp2-bf16")
            uds.save(engine, root / "resaved" / "pipe-pp2-dp2-bf16->pp1-dp2")
            engine.destroy()
        _other_paths(rank, root, checks)
        _refusals(rank, root, checks)
    return checks.result()


def _uneven_autotp(root: Path, checks: Checks) -> None:
    """AutoTP splits a vocabulary of 97 rows 49 + 48: refused by name, nothing committed."""
    import ucpformat.deepspeed as uds
    from ucpformat.errors import UCPError

    with checks.check("refuse an uneven AutoTP split") as problems:
        engine = _autotp_engine(2, 1, vocab_size=97)
        try:
            uds.save(engine, root / "uneven")
            problems.append("saved")
        except UCPError as exc:
            if "lm_head.weight" not in str(exc) or "unevenly" not in str(exc):
                problems.append(f"the error does not name the tensor and why: {exc}")
        if (root / "uneven" / "zarr.json").exists():
            problems.append("a checkpoint was committed")
        engine.destroy()


def _torch_trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    """DsNet and AdamW trained 2 steps by torch alone (the same on every rank)."""
    torch.manual_seed(3)
    net = DsNet()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(2):
        torch.manual_seed(step)
        net(torch.randint(0, 37, (2, 5))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _differs_from_torch(engine: Any, net: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    """The engine's fp32 masters and Adam moments against torch's (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    params = dict(net.named_parameters())
    state = {n: opt.state[p] for n, p in params.items()}
    problems = []
    for n, p in engine.module.named_parameters():
        got = {"fp32": safe_get_full_fp32_param(p),
               "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
               "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
        want = {"fp32": params[n].detach(), "exp_avg": state[n]["exp_avg"],
                "exp_avg_sq": state[n]["exp_avg_sq"]}
        problems += [f"{n} {key} differs" for key in got if not torch.equal(got[key], want[key])]
    if engine.global_steps != 2:
        problems.append(f"global_steps {engine.global_steps}")
    return problems


def _distributed_writers(root: Path, checks: Checks) -> None:
    """Checkpoints written on these 2 ranks by the DCP plugin (``dcp.save`` of the model
    and optimizer state dicts) and by ``ucpformat.torch.save_distributed`` load into
    DeepSpeed engines: masters and Adam moments equal what torch trained."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import ucpformat.deepspeed as uds
    import ucpformat.torch as ucp_torch
    from ucpformat.torch.dcp import UCPWriter

    net, opt = _torch_trained()
    with checks.check("load the DCP plugin's checkpoint") as problems:
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd, "step": 2},
                 storage_writer=UCPWriter(root / "dcp-path"))
        engine = make_engine("dsnet", 3, "bf16", seed=1234)
        uds.load(engine, root / "dcp-path", load_lr_scheduler_states=False)
        problems += _differs_from_torch(engine, net, opt)
        engine.destroy()
    with checks.check("load save_distributed's checkpoint") as problems:
        ucp_torch.save_distributed(root / "distributed-path", model=net, optimizer=opt, step=2)
        engine = make_engine("dsnet", 1, "fp32", seed=1234)
        uds.load(engine, root / "distributed-path", load_lr_scheduler_states=False)
        problems += _differs_from_torch(engine, net, opt)
        engine.destroy()


def _other_paths(rank: int, root: Path, checks: Checks) -> None:
    """Checkpoints of other writers: the importer's, the torch API's, the DCP plugin's,
    save_distributed's."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    import ucpformat.deepspeed as uds

    _distributed_writers(root, checks)

    with checks.check("load ucp convert's checkpoint") as problems:
        mine = make_engine("dsnet", 3, "bf16", seed=1234)
        uds.load(mine, root / "ucp" / "zero2-bf16")
        theirs = make_engine("dsnet", 3, "bf16", seed=1234)
        uds.load(theirs, root / "converted-zero2-bf16")
        problems += differences(snapshot(mine), snapshot(theirs))
        mine.destroy()
        theirs.destroy()
    with checks.check("load the torch API's checkpoint") as problems:
        engine = make_engine("dsnet", 2, "fp32", seed=1234)
        uds.load(engine, root / "torch-path", load_lr_scheduler_states=False)
        want = torch.load(root / "torch-path.pt", weights_only=True)
        names = [n for n, _ in DsNet().named_parameters()]
        state = {names[int(k)]: v for k, v in want["optimizer"]["state"].items()}
        for n, p in engine.module.named_parameters():
            got = {"fp32": safe_get_full_fp32_param(p),
                   "exp_avg": safe_get_full_optimizer_state(p, "exp_avg"),
                   "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq")}
            expect = {"fp32": want["model"][n], **{k: state[n][k] for k in ("exp_avg",
                                                                            "exp_avg_sq")}}
            for key in got:
                if not torch.equal(got[key], expect[key]):
                    problems.append(f"{n} {key} differs")
        if engine.global_steps != 2:
            problems.append(f"global_steps {engine.global_steps}")
        engine.destroy()
    with checks.check("weights only, from a checkpoint without optimizer state") as problems:
        from ucpformat.errors import LoadError

        engine = make_engine("dsnet", 1, "fp32", seed=1234)
        before = snapshot(engine)
        try:
            uds.load(engine, root / "model-only", load_lr_scheduler_states=False)
            problems.append("loaded without optimizer state")
        except LoadError as exc:
            if "load_optimizer_states=False" not in str(exc):
                problems.append(f"the error does not say what to do: {exc}")
        problems += differences(before, snapshot(engine))
        uds.load(engine, root / "model-only", load_optimizer_states=False,
                 load_lr_scheduler_states=False)
        want = torch.load(root / "torch-path.pt", weights_only=True)["model"]
        for n, p in engine.module.named_parameters():
            if not torch.equal(safe_get_full_fp32_param(p), want[n]):
                problems.append(f"{n} was not loaded")
        engine.destroy()


def _with_training_value(source: Path, dest: Path, key: str, value: Any) -> None:
    """A copy of ``source`` whose ``training`` group holds ``value`` under ``key`` (in the
    node's zarr.json and the root's consolidated metadata, the root sealed again)."""
    from ucpformat.testing.hostile import dump, dump_root

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(source, dest)
    root_doc = json.loads((dest / "zarr.json").read_text())
    node = root_doc["consolidated_metadata"]["metadata"]["training"]
    node["attributes"]["ucp"]["values"][key] = value
    (dest / "training" / "zarr.json").write_bytes(dump(node))
    (dest / "zarr.json").write_bytes(dump_root(root_doc))


def _refusals(rank: int, root: Path, checks: Checks) -> None:
    """Bad input is refused on every rank before anything of the engine changes."""
    import ucpformat.deepspeed as uds
    from ucpformat.deepspeed.rank_fragments import inner_optimizer
    from ucpformat.errors import KeyMismatchError, LoadError, ShapeMismatchError, UCPError

    cases: list[tuple[str, str, type[Exception], str, Path]] = [
        ("refuse another shape", "wide", ShapeMismatchError, "fc1.weight",
         root / "ucp" / "zero2-bf16"),
        ("refuse another name", "extra", KeyMismatchError, "extra.weight",
         root / "ucp" / "zero2-bf16"),
        ("refuse a damaged checkpoint", "dsnet", UCPError, "fc2.weight", root / "damaged"),
        ("refuse a value of another kind", "dsnet", LoadError, "param_groups[0].betas",
         root / "bad-value"),
        ("refuse a counter of another kind", "dsnet", LoadError, "training/step",
         root / "bad-step"),
    ]
    # a checkpoint whose Adam betas are a string: refused while planning, not half-applied
    engine = make_engine("dsnet", 2, "bf16")
    train(engine, rank, 1)
    inner_optimizer(engine).param_groups[0]["betas"] = "oops"
    uds.save(engine, root / "bad-value")
    engine.destroy()
    if rank == 0:  # a checkpoint whose training/step is a string (issue 31, item 6)
        _with_training_value(root / "ucp" / "zero2-bf16", root / "bad-step", "step", "abc")
    if rank == 0:  # a copy of a checkpoint with one tensor's data gone
        shutil.rmtree(root / "damaged", ignore_errors=True)
        shutil.copytree(root / "ucp" / "zero2-fp32", root / "damaged")
        shutil.rmtree(root / "damaged" / "optimizer" / "state" / "fc2.weight" / "exp_avg" / "c")
    dist.barrier()
    for check, model, error, tensor, where in cases:
        with checks.check(check) as problems:
            engine = make_engine(model, 2, "bf16" if "damaged" not in str(where) else "fp32",
                                 seed=1234)
            before = snapshot(engine)
            try:
                uds.load(engine, where)
                problems.append("loaded")
            except error as exc:
                # every rank refuses; the ranks whose own regions are fine say why others
                if tensor not in str(exc) and "rank" not in str(exc):
                    problems.append(f"the error names neither {tensor!r} nor a rank: {exc}")
            problems += differences(before, snapshot(engine))
            engine.destroy()


# -- 5. a rank dies while saving -----------------------------------------------------------------


def crash_job(rank: int, world: int, out: str) -> dict[str, Any]:
    import ucpformat.deepspeed as uds
    from ucpformat.checkpoint import write_loop

    _env(rank, world)
    engine = make_engine("dsnet", 2, "fp32")
    train(engine, rank, STEPS)
    uds.save(engine, Path(out) / "crashed", tag="step3")  # committed; latest names it
    train(engine, rank, 1)
    if rank == 1:
        def die(*args: Any, **kwargs: Any) -> Any:
            os._exit(17)  # the process is gone, as if killed, in the middle of writing

        write_loop.write_object = die  # type: ignore[assignment]
    uds.save(engine, Path(out) / "crashed", tag="step4")
    return {"saved": True}


# -- the driver ----------------------------------------------------------------------------------


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"checks": {}, "losses": {}, "bytes_read": {}}
    for rank, res in enumerate(results):
        for name, problems in res.get("checks", {}).items():
            out["checks"].setdefault(name, []).extend(f"rank {rank}: {p}" for p in problems)
        out["losses"].update(res.get("losses", {}))
        out["bytes_read"].update(res.get("bytes_read", {}))
        for key, value in res.items():
            if key not in ("checks", "losses", "bytes_read"):
                out[key] = value
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--skip-demo", action="store_true")
    args = parser.parse_args(argv)
    from ucpformat.deepspeed import demo

    demo.prepare()  # DeepSpeed imported once, in this process; the ranks are forks
    from ucpformat.torch.launch import WorkerError, spawn

    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"checks": {}, "losses": {}, "bytes_read": {}}

    def run(fn: Any, world: int) -> None:
        merged = _merge(spawn(fn, world, str(root), timeout=STAGE_TIMEOUT_S, start_method="fork"))
        for key in ("checks", "losses", "bytes_read"):
            results[key].update(merged.pop(key))
        results.update(merged)

    if not args.skip_demo:
        outcome = demo.run_demo(root / "demo", demo.QUICK, log=lambda line: None)
        results["demo"] = {"losses": outcome.losses, "max_rel_diff": outcome.max_rel_diff,
                           "rtol": outcome.rtol, "ok": outcome.ok, "plot": outcome.plot}
    run(save_job, 4)
    run(prepare_job, 1)
    for world in (2, 3, 1):
        run(resume_job, world)
    try:
        spawn(crash_job, 2, str(root), timeout=STAGE_TIMEOUT_S, start_method="fork")
        results["crash"] = "no rank failed"
    except WorkerError as exc:
        results["crash"] = str(exc)
    (root / "results.json").write_text(json.dumps(results, indent=1))
    sys.stdout.flush()


__all__ = ["LOADS", "SOURCES", "load_name", "main", "repair_universal", "snapshot"]

if __name__ == "__main__":
    main()
