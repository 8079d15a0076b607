"""Resume anywhere: train under one parallel layout, resume under others, same curve.

The headline experiment of universal checkpointing, on CPU in a few minutes:

* **A**: a small GPT trains on 4 processes, tensor parallel 2 x FSDP2 2 on a 2-D mesh
  (``parallelize_module`` + ``fully_shard``: strided, uneven shards). At step ``k`` it
  saves a checkpoint asynchronously (:class:`ucpformat.torch.AsyncSaver`) and trains on
  to the end: the uninterrupted run.
* **B**: 2 processes, FSDP2 2 (no tensor parallelism), load the step-``k`` checkpoint
  and train to the end.
* **C**: 1 process, no parallelism and no ``torch.distributed`` at all, does the same.

Every run sees the same global batch at each step (B and C split it differently across
data-parallel ranks), so the resumed curves follow A's up to floating-point
reduction order: tensor-parallel partial sums, FSDP2's reduce-scatter and the per-rank
means add the same numbers in other orders. The demo prints a table of the losses,
writes ``losses.csv`` and a plot ``resume.png`` (with matplotlib) into ``--out``, and
exits with status 1 if a resumed loss differs from A's by more than ``--rtol``.

    python -m ucpformat.torch.demo [--out DIR] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

#: Relative tolerance between a resumed loss and the uninterrupted one. Measured on CPU
#: (torch 2.13, gloo): the default run's largest difference over steps 76..150 is
#: 1.5e-7 relative, the quick run's 1.2e-7, that is one to three float32 ulps of the
#: loss (the reduction orders differ; most steps are bit-identical). The control run,
#: which resumes everything but the optimizer state, is off by 1e-2. 1e-5 sits about
#: 70 times above the first and 1000 times below the second.
DEFAULT_RTOL = 1e-5


# -- the model ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    vocab: int = 64
    seq_len: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 16  # global batch (sequences per step)
    steps: int = 150
    save_at: int = 75
    lr: float = 1.5e-3
    warmup: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.save_at < self.steps:
            raise ValueError("save_at must lie strictly between 0 and steps")
        if self.batch % 4 or self.dim % self.heads or self.heads % 2:
            raise ValueError("batch must divide by 4, dim by heads, heads by 2")


QUICK = Config(dim=32, layers=1, batch=8, steps=12, save_at=6)


class Attention(torch.nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.q = torch.nn.Linear(cfg.dim, cfg.dim)
        self.k = torch.nn.Linear(cfg.dim, cfg.dim)
        self.v = torch.nn.Linear(cfg.dim, cfg.dim)
        self.proj = torch.nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:  # the local heads under TP
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True
        )
        out: torch.Tensor = self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return out


class MLP(torch.nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = torch.nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(F.gelu(self.fc(x)))
        return out


class Block(torch.nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ln2 = torch.nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(torch.nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.tok_emb = torch.nn.Embedding(cfg.vocab, cfg.dim)
        self.pos_emb = torch.nn.Embedding(cfg.seq_len, cfg.dim)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = torch.nn.LayerNorm(cfg.dim)
        self.head = torch.nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


# -- the data ---------------------------------------------------------------------------------


def corpus(cfg: Config, length: int = 1 << 16) -> np.ndarray[Any, Any]:
    """A deterministic synthetic corpus: a sparse random Markov chain over the vocabulary.

    Each token has four likely successors, so a model can learn the stream down to about
    1.4 nats per token from ln(vocab) = 4.2 at the start.
    """
    rng = np.random.default_rng(1234)
    successors = rng.integers(0, cfg.vocab, size=(cfg.vocab, 4))
    weights = np.array([0.4, 0.3, 0.2, 0.1])
    choice = rng.choice(4, size=length, p=weights)
    out = np.empty(length, dtype=np.int64)
    out[0] = 0
    for i in range(1, length):
        out[i] = successors[out[i - 1], choice[i]]
    return out


def global_batch(cfg: Config, stream: np.ndarray[Any, Any], step: int) -> torch.Tensor:
    """The (batch, seq_len + 1) token windows of a step: the same for every layout."""
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(stream) - cfg.seq_len - 1, size=cfg.batch)
    return torch.from_numpy(np.stack([stream[s : s + cfg.seq_len + 1] for s in starts]))


# -- layouts ----------------------------------------------------------------------------------


@dataclass
class Layout:
    name: str
    tp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.dp


LAYOUT_A = Layout("A: TP 2 x FSDP2 2 (4 processes)", tp=2, dp=2)
LAYOUT_B = Layout("B: FSDP2 2 (2 processes)", tp=1, dp=2)
LAYOUT_C = Layout("C: 1 process, no parallelism", tp=1, dp=1)


def build(cfg: Config, layout: Layout) -> tuple[torch.nn.Module, int]:
    """The model under ``layout``, and this rank's data-parallel index."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg)
    if layout.world == 1:
        return model, 0
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    if layout.tp > 1:
        plan = {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(), "mlp.out": RowwiseParallel(),
        }
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)  # type: ignore[arg-type]
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    coords = mesh.get_coordinate()
    assert coords is not None
    return model, int(coords[0])


def make_optimizer(
    cfg: Config, model: torch.nn.Module, start: int = 0
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW (weight decay 0.1) and its schedule, positioned after ``start`` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    for group in opt.param_groups:  # what a scheduler resumed at ``start`` starts from
        group["initial_lr"] = cfg.lr

    def schedule(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule, last_epoch=start - 1)


def train_steps(
    cfg: Config,
    layout: Layout,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    dp_rank: int,
    start: int,
    stop: int,
    on_step: Any = None,
) -> list[float]:
    """Train steps [start, stop); the global mean loss of each step."""
    import torch.distributed as dist

    stream = corpus(cfg)
    per_rank = cfg.batch // layout.dp
    losses = []
    for step in range(start, stop):
        tokens = global_batch(cfg, stream, step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        value = loss.detach().clone()
        if layout.world > 1:  # mean over data-parallel ranks (TP ranks hold the same loss)
            dist.all_reduce(value)
            value /= layout.world
        losses.append(float(value))
        if on_step is not None:
            on_step(step + 1)
    return losses


# -- the runs (each a process group, started by ucpformat.torch.launch.spawn) ----------------


def run_a(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """Layout A: train all steps; save asynchronously after ``save_at`` steps."""
    from ucpformat.torch.async_save import AsyncSaver

    cfg = Config(**cfg_doc)
    model, dp_rank = build(cfg, LAYOUT_A)
    opt, sched = make_optimizer(cfg, model)
    saver = AsyncSaver()
    blocked: list[float] = []

    def maybe_save(done: int) -> None:
        if done == cfg.save_at:
            saver.save(ckpt, model=model, optimizer=opt, scheduler=sched, step=done,
                       metadata={"demo": "resume anywhere", "layout": LAYOUT_A.name})
            blocked.append(saver.last_blocked_s)

    t0 = time.perf_counter()
    losses = train_steps(cfg, LAYOUT_A, model, opt, sched, dp_rank, 0, cfg.steps, maybe_save)
    saver.close()
    return {"losses": losses, "seconds": time.perf_counter() - t0, "blocked_s": blocked[0]}


def resume(cfg: Config, layout: Layout, ckpt: str) -> dict[str, Any]:
    from ucpformat.torch.distributed import load_distributed

    model, dp_rank = build(cfg, layout)
    opt, sched = make_optimizer(cfg, model)
    t0 = time.perf_counter()
    result = load_distributed(ckpt, model=model, optimizer=opt, scheduler=sched)
    load_s = time.perf_counter() - t0
    if result.step != cfg.save_at:
        raise RuntimeError(f"the checkpoint is of step {result.step}, not {cfg.save_at}")
    t0 = time.perf_counter()
    losses = train_steps(cfg, layout, model, opt, sched, dp_rank, cfg.save_at, cfg.steps)
    return {"losses": losses, "seconds": time.perf_counter() - t0, "load_s": load_s,
            "bytes_read": result.bytes_read}


def resume_without_optimizer(cfg: Config, ckpt: str) -> list[float]:
    """The control: one process resumes the model and the schedule but not the optimizer
    state (fresh AdamW moments and step). Its curve leaves A's at once: the tolerance
    is tight enough to catch a state that was not resumed exactly."""
    from ucpformat.torch.distributed import load_distributed

    model, _ = build(cfg, LAYOUT_C)
    opt, sched = make_optimizer(cfg, model)
    load_distributed(ckpt, model=model, scheduler=sched)
    return train_steps(cfg, LAYOUT_C, model, opt, sched, 0, cfg.save_at, cfg.steps)


def resume_foreign(cfg: Config, layout: Layout, ckpt: str, *,
                   with_optimizer: bool = True) -> list[float]:
    """Resume, under ``layout``, a checkpoint of step ``save_at`` that another framework
    wrote with the GPT's names and AdamW's state (a JAX run: :mod:`ucpformat.jax.demo`)
    but no scheduler nor torch hyperparameters: those are the demo's own, the schedule
    positioned at ``save_at``. Without ``with_optimizer``, the control: fresh AdamW
    moments and steps."""
    from ucpformat.torch.distributed import load_distributed

    model, dp_rank = build(cfg, layout)
    opt, sched = make_optimizer(cfg, model, start=cfg.save_at)
    result = load_distributed(ckpt, model=model, optimizer=opt if with_optimizer else None,
                              strict=with_optimizer)
    if result.step != cfg.save_at:
        raise RuntimeError(f"the checkpoint is of step {result.step}, not {cfg.save_at}")
    return train_steps(cfg, layout, model, opt, sched, dp_rank, cfg.save_at, cfg.steps)


def run_foreign(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """Layout A resumes another framework's checkpoint (:func:`resume_foreign`), then
    the control does."""
    cfg = Config(**cfg_doc)
    return {"losses": resume_foreign(cfg, LAYOUT_A, ckpt),
            "control": resume_foreign(cfg, LAYOUT_A, ckpt, with_optimizer=False)}


def run_b(rank: int, world: int, cfg_doc: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """Layout B: load the checkpoint into FSDP2 on 2 processes and train on."""
    return resume(Config(**cfg_doc), LAYOUT_B, ckpt)


# -- report -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    config: Config
    rtol: float
    losses: dict[str, list[float]]  # "A" over all steps; "B", "C", "control" from save_at
    max_rel_diff: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    plot: str | None = None
    #: what the plot calls the runs and itself (another framework's demo gives its own)
    labels: dict[str, str] = field(default_factory=lambda: {
        "A": LAYOUT_A.name, "B": LAYOUT_B.name, "C": LAYOUT_C.name})
    title: str = "Save on 4 processes (TP 2 x FSDP2 2), resume on 2 and on 1"

    @property
    def ok(self) -> bool:
        return all(d <= self.rtol for k, d in self.max_rel_diff.items() if k != "control")


def compare(outcome: Outcome) -> None:
    a = outcome.losses["A"][outcome.config.save_at :]
    for key in ("B", "C", "control"):
        if key not in outcome.losses:
            continue
        other = outcome.losses[key]
        outcome.max_rel_diff[key] = max(
            abs(x - y) / abs(y) for x, y in zip(other, a, strict=True)
        )


def table(outcome: Outcome) -> str:
    cfg = outcome.config
    lines = [
        f"{'step':>5}  {'A (uninterrupted)':>17}  {'B resumed':>11}  {'C resumed':>11}  "
        f"{'|B-A|/A':>9}  {'|C-A|/A':>9}"
    ]
    for i, a in enumerate(outcome.losses["A"]):
        step = i + 1
        if i < cfg.save_at:
            if step == 1 or step % 5 == 0 or step == cfg.save_at:
                lines.append(f"{step:>5}  {a:>17.6f}  {'':>11}  {'':>11}")
            if step == cfg.save_at:
                lines.append(f"{'':>5}  -- checkpoint saved by A after step {step}; B and C "
                             "load it --")
            continue
        b = outcome.losses["B"][i - cfg.save_at]
        c = outcome.losses["C"][i - cfg.save_at]
        lines.append(
            f"{step:>5}  {a:>17.6f}  {b:>11.6f}  {c:>11.6f}  "
            f"{abs(b - a) / a:>9.1e}  {abs(c - a) / a:>9.1e}"
        )
    return "\n".join(lines)


def write_csv(outcome: Outcome, path: Path) -> None:
    cfg = outcome.config
    rows = ["step,loss_A,loss_B,loss_C"]
    for i, a in enumerate(outcome.losses["A"]):
        b = c = ""
        if i >= cfg.save_at:
            b = repr(outcome.losses["B"][i - cfg.save_at])
            c = repr(outcome.losses["C"][i - cfg.save_at])
        rows.append(f"{i + 1},{a!r},{b},{c}")
    path.write_text("\n".join(rows) + "\n")


def plot(outcome: Outcome, path: Path) -> bool:
    """Loss curves and relative differences as a PNG; False without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return False
    cfg = outcome.config
    steps_all = np.arange(1, cfg.steps + 1)
    steps_resumed = np.arange(cfg.save_at + 1, cfg.steps + 1)
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.6]}
    )
    top.plot(steps_all, outcome.losses["A"], color="black", lw=2.2,
             label=outcome.labels["A"] + ", uninterrupted")
    top.plot(steps_resumed, outcome.losses["B"], "o", ms=4.5, mfc="none", color="tab:blue",
             label=outcome.labels["B"] + ", resumed")
    top.plot(steps_resumed, outcome.losses["C"], "x", ms=4.5, color="tab:orange",
             label=outcome.labels["C"] + ", resumed")
    for ax in (top, bottom):
        ax.axvline(cfg.save_at + 0.5, color="grey", ls="--", lw=1)
    low, high = min(outcome.losses["A"]), max(outcome.losses["A"])
    top.text(cfg.save_at + 1.5, low + 0.55 * (high - low),
             f"UCP checkpoint saved by A\nafter step {cfg.save_at}", color="grey",
             va="top", fontsize=9)
    top.set_ylabel("training loss (nats/token)")
    top.set_title(outcome.title)
    top.legend(loc="upper right", fontsize=9)
    a = np.asarray(outcome.losses["A"][cfg.save_at :])
    floor = 1e-10
    series = [("B", "tab:blue", "o", "|B - A| / A"), ("C", "tab:orange", "x", "|C - A| / A"),
              ("control", "grey", "^", "control: optimizer state not resumed")]
    for key, color, marker, label in series:
        if key not in outcome.losses:
            continue
        rel = np.abs(np.asarray(outcome.losses[key]) - a) / a
        bottom.semilogy(steps_resumed, np.maximum(rel, floor), marker, color=color,
                        ms=4, mfc="none" if marker != "x" else color, label=label)
    bottom.axhline(outcome.rtol, color="red", lw=1, label=f"tolerance {outcome.rtol:g}")
    bottom.text(steps_all[0], floor * 1.8, "bit-identical losses are drawn here",
                fontsize=8, color="grey", va="bottom")
    bottom.set_ylim(floor / 3, 1.0)
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative difference")
    bottom.legend(loc="upper left", fontsize=7.5, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- main -------------------------------------------------------------------------------------


def run_demo(
    out: Path,
    cfg: Config,
    *,
    rtol: float = DEFAULT_RTOL,
    log: Any = print,
    timeout: float = 600.0,
) -> Outcome:
    """The three runs, the comparison, the table, ``losses.csv``, ``resume.png``."""
    from ucpformat.torch.launch import spawn

    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / f"checkpoint-step-{cfg.save_at}"
    if ckpt.exists():
        shutil.rmtree(ckpt)
    doc = asdict(cfg)
    timings: dict[str, float] = {}

    log(f"[A] {LAYOUT_A.name}: {cfg.steps} steps, asynchronous save after step "
        f"{cfg.save_at} ...")
    t0 = time.perf_counter()
    a = spawn(run_a, LAYOUT_A.world, doc, str(ckpt), timeout=timeout)[0]
    timings["A (s, wall)"] = time.perf_counter() - t0
    timings["A save, training blocked (s)"] = a["blocked_s"]
    log(f"    done in {timings['A (s, wall)']:.1f} s; the save blocked training for "
        f"{a['blocked_s'] * 1e3:.1f} ms")

    log(f"[B] {LAYOUT_B.name}: load the checkpoint, train steps {cfg.save_at + 1}.."
        f"{cfg.steps} ...")
    t0 = time.perf_counter()
    b = spawn(run_b, LAYOUT_B.world, doc, str(ckpt), timeout=timeout)[0]
    timings["B (s, wall)"] = time.perf_counter() - t0
    log(f"    done in {timings['B (s, wall)']:.1f} s (load {b['load_s'] * 1e3:.0f} ms, "
        f"{b['bytes_read'] / 1024:.0f} KiB read by rank 0)")

    log(f"[C] {LAYOUT_C.name}: load the checkpoint, train steps {cfg.save_at + 1}.."
        f"{cfg.steps} ...")
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c = resume(cfg, LAYOUT_C, str(ckpt))
        timings["C (s, wall)"] = time.perf_counter() - t0
        log(f"    done in {timings['C (s, wall)']:.1f} s")
        log("[control] 1 process, model and schedule resumed but not the optimizer state ...")
        control = resume_without_optimizer(cfg, str(ckpt))
    finally:
        torch.set_num_threads(threads)

    outcome = Outcome(
        cfg, rtol,
        {"A": a["losses"], "B": b["losses"], "C": c["losses"], "control": control},
        timings=timings,
    )
    compare(outcome)
    log("")
    log(table(outcome))
    log("")
    write_csv(outcome, out / "losses.csv")
    (out / "summary.json").write_text(json.dumps(
        {"config": doc, "rtol": rtol, "max_rel_diff": outcome.max_rel_diff,
         "ok": outcome.ok, "timings": timings, "losses": outcome.losses}, indent=2) + "\n")
    png = out / "resume.png"
    if plot(outcome, png):
        outcome.plot = str(png)
    for key in ("B", "C"):
        verdict = "within" if outcome.max_rel_diff[key] <= rtol else "OUTSIDE"
        log(f"max |{key} - A| / A over steps {cfg.save_at + 1}..{cfg.steps}: "
            f"{outcome.max_rel_diff[key]:.2e} ({verdict} the tolerance {rtol:g})")
    log(f"control, optimizer state not resumed: max relative difference "
        f"{outcome.max_rel_diff['control']:.2e} (a lost state is caught by the tolerance: "
        f"{'yes' if outcome.max_rel_diff['control'] > rtol else 'NO'})")
    log(f"wrote {out / 'losses.csv'}, {out / 'summary.json'}"
        + (f", {png}" if outcome.plot else " (no plot: matplotlib is not installed)"))
    return outcome


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="demo-out", help="output directory (default: demo-out)")
    parser.add_argument("--steps", type=int, default=None,
                        help="training steps (default 150; 12 with --quick); saved half-way")
    parser.add_argument("--quick", action="store_true",
                        help="a smaller model and fewer steps (a test runs this)")
    parser.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                        help=f"relative tolerance of resumed losses (default {DEFAULT_RTOL:g})")


def run(args: argparse.Namespace) -> int:
    """Run the demo from parsed arguments; 0 if the resumed curves match, 1 otherwise."""
    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = Config(**{**asdict(cfg), "steps": args.steps, "save_at": args.steps // 2})
    outcome = run_demo(Path(args.out), cfg, rtol=args.rtol)
    if not outcome.ok:
        print("FAILED: a resumed run left the uninterrupted curve", file=sys.stderr)
        return 1
    print("OK: the runs resumed on 2 processes and on 1 follow the uninterrupted run")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ucpformat.torch.demo",
        description="Train on 4 processes (TP 2 x FSDP2 2), save a UCP checkpoint, resume "
        "on 2 (FSDP2) and on 1, and compare the loss curves.",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
