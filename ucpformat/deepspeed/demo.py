"""Resume anywhere with DeepSpeed: ZeRO-2 on 4 processes, ZeRO-3 on 2, no ZeRO on 1.

The experiment of universal checkpointing (Wagle et al.), with DeepSpeed engines on CPU:

* **A**: the small GPT of :mod:`ucpformat.torch.demo` trains under DeepSpeed ZeRO-2 on 4
  processes (fp32, AdamW, a warm-up + cosine LR schedule). After step ``k`` it saves
  with :func:`ucpformat.deepspeed.save` (asynchronously: training goes on while the
  background thread writes) and trains to the end: the uninterrupted run.
* **B**: 2 processes, ZeRO-3, load the checkpoint with :func:`ucpformat.deepspeed.load`
  and train to the end.
* **C**: 1 process, DeepSpeed without ZeRO (the torch optimizer itself), the same.
* **control**: like C, but the optimizer state is not loaded.

Every run sees the same global batch at each step (each data-parallel rank its slice),
so the resumed curves follow A's up to the order of floating-point reductions. Prints
the loss table, writes ``losses.csv``, ``summary.json`` and ``resume.png`` into
``--out``, and exits with status 1 if a resumed loss leaves A's by more than ``--rtol``.

    ucp demo --framework deepspeed [--out DIR] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ucpformat.torch.demo import (
    DEFAULT_RTOL,
    GPT,
    QUICK,
    Config,
    Outcome,
    compare,
    corpus,
    global_batch,
    plot,
    table,
    write_csv,
)

#: (name, processes, ZeRO stage) of the three runs
LAYOUTS = {"A": ("A: ZeRO-2, 4 processes", 4, 2), "B": ("B: ZeRO-3, 2 processes", 2, 3),
           "C": ("C: no ZeRO, 1 process", 1, 0)}


def prepare() -> None:
    """Import DeepSpeed once, in the parent, before forking the workers.

    DeepSpeed builds a shared-memory op for collectives on CPU when its process group
    starts; gloo needs none, and building it needs a compiler and minutes: the demo
    turns it off. Its optimizer setup imports torch's compiler stack, which the forked
    workers then share (:func:`ucpformat.torch.launch.spawn`).
    """
    import importlib

    os.environ.setdefault("DS_BUILD_OPS", "0")
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    setattr(ds_torch, "build_shm_op", lambda: None)  # noqa: B010
    importlib.import_module("deepspeed.runtime.zero.muon.muon_optimizer")  # torch.compile
    importlib.import_module("torch._dynamo")


def ds_config(cfg: Config, world: int, stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": cfg.steps, "warmup_num_steps": cfg.warmup,
            "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
    }


def engine_for(cfg: Config, rank: int, world: int, stage: int) -> Any:
    """A DeepSpeed engine of the demo's GPT on this process (the process group is up)."""
    import deepspeed

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(cfg, world, stage))
    return engine


def train_steps(cfg: Config, engine: Any, rank: int, world: int, start: int, stop: int,
                on_step: Any = None) -> list[float]:
    """Train steps [start, stop); the global mean loss of each step."""
    stream = corpus(cfg)
    per_rank = cfg.batch // world
    losses = []
    for step in range(start, stop):
        tokens = global_batch(cfg, stream, step)[rank * per_rank:(rank + 1) * per_rank]
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        value = loss.detach().clone()
        if world > 1:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
        if on_step is not None:
            on_step(step + 1)
    return losses


def run_a(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """A: train every step under ZeRO-2; save asynchronously after ``save_at`` steps."""
    from ucpformat.deepspeed import save, wait

    cfg = Config(**cfg_doc)
    engine = engine_for(cfg, rank, world, LAYOUTS["A"][2])
    blocked: list[float] = []

    def maybe_save(done: int) -> None:
        if done == cfg.save_at:
            t0 = time.perf_counter()
            save(engine, ckpt, async_=True, client_state={"demo": "resume anywhere"})
            blocked.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    losses = train_steps(cfg, engine, rank, world, 0, cfg.steps, maybe_save)
    wait()
    return {"losses": losses, "seconds": time.perf_counter() - t0, "blocked_s": blocked[0]}


def resume(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str, stage: int,
           optimizer: bool = True) -> dict[str, Any]:
    """Load the checkpoint into a fresh engine, then train to the end."""
    from ucpformat.deepspeed import load

    cfg = Config(**cfg_doc)
    engine = engine_for(cfg, rank, world, stage)
    t0 = time.perf_counter()
    result = load(engine, ckpt, load_optimizer_states=optimizer)
    load_s = time.perf_counter() - t0
    if result.step != cfg.save_at:
        raise RuntimeError(f"the checkpoint is of step {result.step}, not {cfg.save_at}")
    losses = train_steps(cfg, engine, rank, world, cfg.save_at, cfg.steps)
    return {"losses": losses, "load_s": load_s, "bytes_read": result.bytes_read}


def run_b(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str) -> dict[str, Any]:
    return resume(rank, world, cfg_doc, ckpt, LAYOUTS["B"][2])


def run_c(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """C, then the control (the same without the optimizer state), on one process."""
    out = resume(rank, world, cfg_doc, ckpt, LAYOUTS["C"][2])
    out["control"] = resume(rank, world, cfg_doc, ckpt, LAYOUTS["C"][2], optimizer=False)[
        "losses"]
    return out


def run_demo(out: Path, cfg: Config, *, rtol: float = DEFAULT_RTOL, log: Any = print,
             timeout: float = 600.0) -> Outcome:
    """The runs (forked from this process), the comparison, table, CSV and plot."""
    from ucpformat.torch.launch import spawn

    prepare()
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / f"checkpoint-step-{cfg.save_at}"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    doc = asdict(cfg)
    timings: dict[str, float] = {}
    results: dict[str, Any] = {}
    for key, fn in (("A", run_a), ("B", run_b), ("C", run_c)):
        name, world, _ = LAYOUTS[key]
        log(f"[{key}] {name}: " + (f"{cfg.steps} steps, save after step {cfg.save_at} ..."
                                   if key == "A" else
                                   f"load, train steps {cfg.save_at + 1}..{cfg.steps} ..."))
        t0 = time.perf_counter()
        results[key] = spawn(fn, world, doc, str(ckpt), timeout=timeout,
                             start_method="fork")[0]
        timings[f"{key} (s, wall)"] = time.perf_counter() - t0
        log(f"    done in {timings[f'{key} (s, wall)']:.1f} s")
    timings["A save, training blocked (s)"] = results["A"]["blocked_s"]
    outcome = Outcome(cfg, rtol, {"A": results["A"]["losses"], "B": results["B"]["losses"],
                                  "C": results["C"]["losses"],
                                  "control": results["C"]["control"]},
                      timings=timings, labels={k: v[0] for k, v in LAYOUTS.items()},
                      title="DeepSpeed: save under ZeRO-2 on 4 processes, resume under ZeRO-3 "
                            "on 2 and without ZeRO on 1")
    compare(outcome)
    log("")
    log(table(outcome))
    log("")
    write_csv(outcome, out / "losses.csv")
    (out / "summary.json").write_text(json.dumps(
        {"config": doc, "rtol": rtol, "max_rel_diff": outcome.max_rel_diff, "ok": outcome.ok,
         "timings": timings, "losses": outcome.losses}, indent=2) + "\n")
    png = out / "resume.png"
    if plot(outcome, png):
        outcome.plot = str(png)
    for key in ("B", "C"):
        verdict = "within" if outcome.max_rel_diff[key] <= rtol else "OUTSIDE"
        log(f"max |{key} - A| / A over steps {cfg.save_at + 1}..{cfg.steps}: "
            f"{outcome.max_rel_diff[key]:.2e} ({verdict} the tolerance {rtol:g})")
    log(f"control, optimizer state not resumed: max relative difference "
        f"{outcome.max_rel_diff['control']:.2e}")
    log(f"wrote {out / 'losses.csv'}, {out / 'summary.json'}"
        + (f", {png}" if outcome.plot else " (no plot: matplotlib is not installed)"))
    return outcome


def run(args: argparse.Namespace) -> int:
    """The demo from parsed arguments (``ucp demo --framework deepspeed``)."""
    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = Config(**{**asdict(cfg), "steps": args.steps, "save_at": args.steps // 2})
    outcome = run_demo(Path(args.out), cfg, rtol=args.rtol)
    if not outcome.ok:
        print("FAILED: a resumed run left the uninterrupted curve", file=sys.stderr)
        return 1
    print("OK: the runs resumed under ZeRO-3 on 2 processes and without ZeRO on 1 follow "
          "the uninterrupted ZeRO-2 run")
    return 0


__all__ = ["LAYOUTS", "ds_config", "engine_for", "prepare", "run", "run_a", "run_b", "run_c",
           "run_demo", "train_steps"]
