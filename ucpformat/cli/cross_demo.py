"""``ucp demo --framework cross``: one GPT, trained half-way in PyTorch and resumed in JAX,
and the reverse, each resumed curve following the run it was saved from.

Three steps, each framework in processes of its own (neither imports the other):

1. **PyTorch** (:func:`ucpformat.torch.demo.run_a`, the torch demo's run A): the GPT
   trains on 4 gloo processes, tensor parallel 2 x FSDP2 2, every step, saving a UCP
   checkpoint half-way: the curve ``torch``.
2. **JAX** (:func:`ucpformat.jax.demo.cross`, a child process with 8 virtual CPU
   devices): on a (2, 4) mesh, resumes that checkpoint through
   :func:`ucpformat.jax.torch_keymap` and trains to the end (``torch_to_jax``), then the
   control without the optimizer state; then trains the same GPT from the start,
   saving half-way as PyTorch names it: the curve ``jax``.
3. **PyTorch** (:func:`ucpformat.torch.demo.run_foreign`): 4 processes resume JAX's
   checkpoint under TP 2 x FSDP2 2 (``jax_to_torch``), then the control.

Each resumed curve must follow the curve it was saved from within ``--rtol``
(:data:`DEFAULT_RTOL`: the frameworks' float32 kernels differ), and each control must
not. The table is printed and written (``table.md``), with ``losses.csv``,
``summary.json`` and the plot ``resume.png`` (matplotlib) in ``--out``, beside both
checkpoints.

The torch workers are forked from this process (torch is imported once, not in each of
the 4 workers), which must therefore have started no threads: a test runs the command
in a process of its own. JAX is imported here only for the child's environment; its
backend starts in the child alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Relative tolerance of a resumed loss against the run it was saved from, across
#: frameworks. Measured on CPU (torch 2.13 on gloo, jax 0.10.2; docs/jax.md): 7.4e-7 at
#: most over the 75 resumed steps of the default size, 2.3e-7 at the quick size, a few
#: float32 ulps of the loss: the loaded values are bit-equal, the kernels differ
#: (attention, GELU, the reductions' order, AdamW's decay applied before or with the
#: update). The controls are 1.1e-2 (default) and 3.6e-4 (quick) away. 1e-5 lies 13
#: times above the first and 36 times below the closest control.
DEFAULT_RTOL = 1e-5

#: (key, label, reference key, whether it must follow the reference)
RUNS = (
    ("torch", "PyTorch, TP 2 x FSDP2 2 (4 processes), uninterrupted", None, None),
    ("torch_to_jax", "JAX (2, 4) mesh, resumed from PyTorch", "torch", True),
    ("torch_to_jax_control", "control: JAX resumed without the optimizer state", "torch",
     False),
    ("jax", "JAX (2, 4) mesh, uninterrupted", None, None),
    ("jax_to_torch", "PyTorch TP 2 x FSDP2 2, resumed from JAX", "jax", True),
    ("jax_to_torch_control", "control: PyTorch resumed without the optimizer state", "jax",
     False),
)


@dataclass
class CrossOutcome:
    """Every curve (``torch`` and ``jax`` over all steps, the others from ``save_at``),
    each resumed curve's largest relative difference to its reference, the verdict."""

    steps: int
    save_at: int
    rtol: float
    losses: dict[str, list[float]]
    max_rel_diff: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    plot: str | None = None

    def compare(self) -> None:
        for key, _, ref, _ in RUNS:
            if ref is not None:
                reference = self.losses[ref][self.save_at:]
                self.max_rel_diff[key] = max(
                    abs(x - y) / abs(y) for x, y in zip(self.losses[key], reference, strict=True))

    @property
    def ok(self) -> bool:
        """Every resume within the tolerance and every control outside it."""
        return all((self.max_rel_diff[key] <= self.rtol) == follows
                   for key, _, ref, follows in RUNS if ref is not None)


def summary_table(outcome: CrossOutcome) -> str:
    lines = ["| run | last loss | max relative difference to the run it resumes, steps "
             f"{outcome.save_at + 1}..{outcome.steps} |", "|---|---:|---:|"]
    for key, label, ref, _ in RUNS:
        diff = "-" if ref is None else f"{outcome.max_rel_diff[key]:.2e}"
        lines.append(f"| {label} | {outcome.losses[key][-1]:.4f} | {diff} |")
    return "\n".join(lines)


def step_table(outcome: CrossOutcome) -> str:
    """The losses step by step, both directions side by side."""
    k = outcome.save_at
    lines = [f"{'step':>5}  {'PyTorch':>9}  {'JAX res.':>9}  {'|J-T|/T':>8}  {'control':>8}"
             f"   {'JAX':>9}  {'PyT res.':>9}  {'|T-J|/J':>8}  {'control':>8}"]
    for i in range(outcome.steps):
        t, j = outcome.losses["torch"][i], outcome.losses["jax"][i]
        if i < k:
            if i == 0 or (i + 1) % 5 == 0 or i + 1 == k:
                lines.append(f"{i + 1:>5}  {t:>9.5f}  {'':>9}  {'':>8}  {'':>8}   {j:>9.5f}")
            if i + 1 == k:
                lines.append(f"{'':>5}  -- saved after step {k}: each framework resumes the "
                             "other's checkpoint --")
            continue
        tj, tjc, jt, jtc = (outcome.losses[key][i - k] for key in (
            "torch_to_jax", "torch_to_jax_control", "jax_to_torch", "jax_to_torch_control"))
        lines.append(f"{i + 1:>5}  {t:>9.5f}  {tj:>9.5f}  {abs(tj - t) / t:>8.1e}  "
                     f"{abs(tjc - t) / t:>8.1e}   {j:>9.5f}  {jt:>9.5f}  "
                     f"{abs(jt - j) / j:>8.1e}  {abs(jtc - j) / j:>8.1e}")
    return "\n".join(lines)


def write_csv(outcome: CrossOutcome, path: Path) -> None:
    keys = [key for key, *_ in RUNS]
    rows = ["step," + ",".join(keys)]
    for i in range(outcome.steps):
        cells = []
        for key in keys:
            curve = outcome.losses[key]
            offset = outcome.steps - len(curve)
            cells.append(repr(curve[i - offset]) if i >= offset else "")
        rows.append(f"{i + 1}," + ",".join(cells))
    path.write_text("\n".join(rows) + "\n")


def plot(outcome: CrossOutcome, path: Path) -> bool:
    """Both directions' curves and relative differences as a PNG; False without
    matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found,unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
        import numpy as np
    except ImportError:
        return False
    k, n = outcome.save_at, outcome.steps
    every, resumed = np.arange(1, n + 1), np.arange(k + 1, n + 1)
    labels = {key: label for key, label, *_ in RUNS}
    fig, axes = plt.subplots(2, 2, figsize=(12, 7), sharex=True,
                             gridspec_kw={"height_ratios": [3, 1.6]})
    floor = 1e-10
    for col, (ref, run, control, title) in enumerate((
            ("torch", "torch_to_jax", "torch_to_jax_control", "PyTorch -> JAX"),
            ("jax", "jax_to_torch", "jax_to_torch_control", "JAX -> PyTorch"))):
        top, bottom = axes[0][col], axes[1][col]
        top.plot(every, outcome.losses[ref], color="black", lw=2.2, label=labels[ref])
        top.plot(resumed, outcome.losses[run], "o", ms=4, mfc="none", color="tab:blue",
                 label=labels[run])
        top.plot(resumed, outcome.losses[control], "--", color="grey", label=labels[control])
        top.set_title(f"{title}: saved after step {k}, resumed")
        top.set_ylabel("training loss (nats/token)")
        top.legend(loc="upper right", fontsize=8)
        reference = np.asarray(outcome.losses[ref][k:])
        for key, color, marker in ((run, "tab:blue", "o"), (control, "grey", "^")):
            rel = np.abs(np.asarray(outcome.losses[key]) - reference) / reference
            bottom.semilogy(resumed, np.maximum(rel, floor), marker, color=color, ms=4,
                            mfc="none", label=labels[key])
        bottom.axhline(outcome.rtol, color="red", lw=1, label=f"tolerance {outcome.rtol:g}")
        bottom.text(1, floor * 1.8, "bit-identical losses are drawn here", fontsize=8,
                    color="grey", va="bottom")
        bottom.set_ylim(floor / 3, 1.0)
        bottom.set_xlabel("step")
        bottom.set_ylabel("relative difference")
        bottom.legend(loc="upper left", fontsize=7)
        for ax in (top, bottom):
            ax.axvline(k + 0.5, color="grey", ls=":", lw=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run_cross(out: Path, cfg_doc: dict[str, Any], *, rtol: float = DEFAULT_RTOL,
              log: Any = print, timeout: float = 600.0) -> CrossOutcome:
    """The three steps, the comparison and the files in ``out``."""
    from ucpformat.jax.demo import child_env
    from ucpformat.torch.demo import LAYOUT_A, run_a, run_foreign
    from ucpformat.torch.launch import WorkerError, spawn

    out.mkdir(parents=True, exist_ok=True)
    steps, save_at = cfg_doc["steps"], cfg_doc["save_at"]
    torch_ckpt, jax_ckpt = out / f"torch-step-{save_at}", out / f"jax-step-{save_at}"
    for ckpt in (torch_ckpt, jax_ckpt):
        if ckpt.exists():
            shutil.rmtree(ckpt)
    timings: dict[str, float] = {}

    log(f"[1/3] PyTorch, {LAYOUT_A.name}: {steps} steps, saved after step {save_at} ...")
    t0 = time.perf_counter()
    torch_run = spawn(run_a, LAYOUT_A.world, cfg_doc, str(torch_ckpt), timeout=timeout,
                      start_method="fork")[0]
    timings["PyTorch run (s)"] = time.perf_counter() - t0

    log("[2/3] JAX, (2, 4) mesh of 8 CPU devices: resume PyTorch's checkpoint, the control, "
        f"then {steps} steps from the start, saved after step {save_at} ...")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ucp-cross-") as tmp:
        result = Path(tmp) / "jax.json"
        argv = [sys.executable, "-m", "ucpformat.jax.demo", "cross", json.dumps(cfg_doc),
                str(torch_ckpt), str(jax_ckpt), str(result)]
        try:
            done = subprocess.run(argv, env=child_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            raise WorkerError(f"the JAX process did not finish within {timeout:.0f} s") from None
        if done.returncode != 0:
            raise WorkerError(f"the JAX process failed (exit status {done.returncode})")
        jax_curves = json.loads(result.read_text())
    timings["JAX runs (s)"] = time.perf_counter() - t0

    log(f"[3/3] PyTorch, {LAYOUT_A.name}: resume JAX's checkpoint, then the control ...")
    t0 = time.perf_counter()
    foreign = spawn(run_foreign, LAYOUT_A.world, cfg_doc, str(jax_ckpt), timeout=timeout,
                    start_method="fork")[0]
    timings["PyTorch resumes (s)"] = time.perf_counter() - t0

    outcome = CrossOutcome(steps, save_at, rtol, {
        "torch": torch_run["losses"], **jax_curves,
        "jax_to_torch": foreign["losses"], "jax_to_torch_control": foreign["control"]},
        timings=timings)
    outcome.compare()
    table = summary_table(outcome)
    log("")
    log(step_table(outcome))
    log("")
    log(table)
    log("")
    (out / "table.md").write_text(table + "\n")
    write_csv(outcome, out / "losses.csv")
    png = out / "resume.png"
    if plot(outcome, png):
        outcome.plot = str(png)
    (out / "summary.json").write_text(json.dumps(
        {"config": cfg_doc, "rtol": rtol, "max_rel_diff": outcome.max_rel_diff,
         "ok": outcome.ok, "timings": timings, "losses": outcome.losses}, indent=2) + "\n")
    for key, label, ref, follows in RUNS:
        if ref is not None:
            inside = outcome.max_rel_diff[key] <= rtol
            verdict = ("within" if inside else "OUTSIDE") if follows else (
                "outside" if not inside else "INSIDE")
            log(f"{label}: max relative difference {outcome.max_rel_diff[key]:.2e} "
                f"({verdict} the tolerance {rtol:g}"
                f"{'' if follows else '; a control must lie outside it'})")
    log(f"wrote {out / 'table.md'}, {out / 'losses.csv'}, {out / 'summary.json'}"
        + (f", {png}" if outcome.plot else " (no plot: matplotlib is not installed)"))
    return outcome


def run(args: argparse.Namespace) -> int:
    """The command from parsed arguments (``--quick``, ``--steps``, ``--rtol``, ``--out``):
    0 if every resume follows and every control does not, else 1."""
    from ucpformat.torch.demo import QUICK, Config

    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = Config(**{**asdict(cfg), "steps": args.steps, "save_at": args.steps // 2})
    rtol = DEFAULT_RTOL if args.rtol is None else args.rtol
    outcome = run_cross(Path(args.out), asdict(cfg), rtol=rtol)
    if not outcome.ok:
        print("FAILED: a resumed run left the curve it was saved from, or a control did not",
              file=sys.stderr)
        return 1
    print("OK: PyTorch -> JAX and JAX -> PyTorch follow the runs they resume; the controls "
          "do not")
    return 0


__all__ = ["DEFAULT_RTOL", "RUNS", "CrossOutcome", "run", "run_cross"]
