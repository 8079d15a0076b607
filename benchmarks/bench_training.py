"""Training while an asynchronous save runs: step time against no save, per saver.

A small transformer (``torch.nn.TransformerEncoder``, AdamW) trains on the CPU in a
child process of its own (a one-rank gloo group: DCP's process mode needs one), with
one torch thread (the save has the other cores). Each
repetition, for each method in a rotating order: steps without a save (the baseline of
that repetition), then one asynchronous save of the model and optimizer state started
between two steps, and steps until it is committed. Per method:

* **blocked**: how long the save call held the training loop (its snapshot);
* **slowdown**: the median step time while the save was in flight over the median
  baseline step time of the same repetition (1.00: training did not notice);
* **save**: call to commit.

Methods: ``ucpformat.torch.AsyncSaver.save`` with its writer in a thread, in a
process of its own (``writer="process"``, which yields the CPU to training by default)
and in one that does not (``writer_nice=0``); DCP ``async_save`` with its
``FileSystemWriter`` in thread and process modes (``AsyncCheckpointerType``); DCP
``async_save`` with the UCP plugin (:class:`ucpformat.torch.dcp.UCPWriter`) in both
modes. The first repetition warms up (DCP's process mode starts its background process
then) and is not counted. Every save writes a new directory, none fsynced
(``FileSystemWriter(sync_files=False)``, ``durable=False``): on a machine shared by
other work, fsync times are the disk's, not the savers'.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import Table

METHODS = ("ucpformat AsyncSaver, thread", "ucpformat AsyncSaver, process",
           "ucpformat AsyncSaver, process nice 0", "DCP thread", "DCP process",
           "UCP plugin, DCP thread", "UCP plugin, DCP process")
#: Sequences x tokens of a training step's batch.
BATCH = (2, 32)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(width: int, layers: int, repeats: int, root: Path) -> dict[str, Any]:
    """The measurement itself (run in the child process, a process group of one made)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    from ucpformat.torch.async_save import AsyncSaver
    from ucpformat.torch.dcp import UCPWriter

    warnings.filterwarnings("ignore")
    # one thread: on a machine of few cores, OpenMP's spinning threads make step times
    # swing by 10x as soon as anything else runs; the save gets the other cores
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, layers),
                                torch.nn.Linear(width, width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # a small batch: a step of tens of ms on a quiet core, so that many steps fall inside
    # a save and the median step is measured, not one step that overlapped it
    batch = torch.randn(*BATCH, width)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(batch).square().mean().backward()
        opt.step()
        return time.perf_counter() - t0

    step()  # optimizer state exists from here on
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for s in opt.state.values()
                  for t in s.values() if isinstance(t, torch.Tensor))
    savers = {METHODS[0]: AsyncSaver(), METHODS[1]: AsyncSaver(writer="process"),
              METHODS[2]: AsyncSaver(writer="process", writer_nice=0)}
    process, thread = AsyncCheckpointerType.PROCESS, AsyncCheckpointerType.THREAD

    def start(method: str, path: str) -> Any:
        if method in savers:
            return savers[method].save(path, model=model, optimizer=opt, durable=False)
        msd, osd = get_state_dict(model, opt)  # optimizer state keyed by FQN
        state = {"model": msd, "optim": osd}
        kind = process if method.endswith("process") else thread
        writer = (UCPWriter(path, durable=False) if method.startswith("UCP")
                  else dcp.FileSystemWriter(path, sync_files=False))
        return dcp.async_save(state, storage_writer=writer, async_checkpointer_type=kind)

    base_steps = 5
    load_before = os.getloadavg()
    rows: dict[str, dict[str, list[float]]] = {
        m: {"blocked": [], "slowdown": [], "save": [], "steps": []} for m in METHODS}
    for r in range(repeats + 1):
        order = METHODS[r % len(METHODS):] + METHODS[:r % len(METHODS)]
        for method in order:
            baseline = statistics.median(step() for _ in range(base_steps))
            path = str(root / f"{method.replace(' ', '_').replace(',', '')}-{r}")
            t0 = time.perf_counter()
            future = start(method, path)
            blocked = time.perf_counter() - t0
            during = []
            while not future.done():
                during.append(step())
            future.result()
            total = time.perf_counter() - t0
            if r:
                data = rows[method]
                data["blocked"].append(blocked)
                data["save"].append(total)
                data["steps"].append(len(during))
                if during:
                    data["slowdown"].append(statistics.median(during) / baseline)
    for saver in savers.values():
        saver.close()
    return {"nbytes": nbytes, "repeats": repeats, "width": width, "layers": layers,
            "load": [load_before, os.getloadavg()],
            "rows": rows, "threads": torch.get_num_threads(),
            "step_s": statistics.median(step() for _ in range(base_steps))}


def child(argv: list[str]) -> None:
    """``python -m benchmarks.bench_training <out.json> <width> <layers> <repeats> <port>``"""
    import torch.distributed as dist

    out, width, layers, repeats, port = argv[0], *(int(a) for a in argv[1:])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    with tempfile.TemporaryDirectory(prefix="ucp-bench-train-") as tmp:
        result = measure(width, layers, repeats, Path(tmp))
    Path(out).write_text(json.dumps(result))
    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._CHECKPOINT_PROCESS = None  # its finaliser ends the background process
    import gc

    gc.collect()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def run(quick: bool = False, *, width: int | None = None, layers: int | None = None,
        repeats: int | None = None) -> list[Table]:
    width = width or (128 if quick else 512)
    layers = layers or (2 if quick else 6)
    repeats = repeats or (1 if quick else 5)
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="ucp-bench-train-") as tmp:
        out = Path(tmp) / "result.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(repo), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_training", str(out), str(width),
             str(layers), str(repeats), str(_free_port())],
            cwd=repo, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench_training's child failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-3000:]}")
        m = json.loads(out.read_text())
    return [table(m)]


def table(m: dict[str, Any]) -> Table:
    med = statistics.median
    t = Table(
        title=f"Training while an async save runs: {m['nbytes'] / 2**20:,.0f} MiB of model "
              "and AdamW state",
        columns=["method", "blocked s", "step slowdown during the save", "steps during",
                 "save s (call to commit)", "slowdown × best DCP mode"],
    )
    slow = {k: med(v["slowdown"]) if v["slowdown"] else float("nan")
            for k, v in m["rows"].items()}
    best_dcp = min(slow["DCP thread"], slow["DCP process"])
    for method in METHODS:
        v = m["rows"][method]
        t.rows.append([method, f"{med(v['blocked']):.3f}", f"{slow[method]:.2f}",
                       f"{med(v['steps']):.0f}", f"{med(v['save']):.2f}",
                       f"{slow[method] / best_dcp:.2f}"])
    t.notes += [
        f"a {m['layers']}-layer TransformerEncoder of width {m['width']} + a linear head, "
        f"AdamW, batch {BATCH[0]} x {BATCH[1]} tokens, {m['threads']} torch thread(s) "
        f"({os.cpu_count()} cores); a step takes {m['step_s'] * 1000:.0f} ms without a save",
        f"median of {m['repeats']} round-robin repetitions after one warm-up; slowdown: "
        "median step time while the save is in flight over the median of the 5 steps "
        "before it (same repetition); the last column over the better of DCP's two modes "
        "(at most 1.00: the target)",
        "load average (1/5/15 min) at the start and the end: "
        + " and ".join("/".join(f"{x:.1f}" for x in avg) for avg in m["load"]),
    ]
    t.data = {"training": {k: slow[k] for k in METHODS}}
    return t


if __name__ == "__main__":
    child(sys.argv[1:])
