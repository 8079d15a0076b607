"""A resume as it happens: one load into a new process whose model is built (issue 28).

``bench_throughput`` loads again and again in one process, so a loader that gets new
memory finds what the allocator kept from the load before, and one that frees the model's
memory while it loads (the default load hands its checked staging to the model) finds it
later: its figures measure the allocator's recycling as much as the loader. A training
run resumes once, in a new process, after building its model. Here every load is that:
a fresh Python process builds the model (the synthetic state's shapes and types, memory
zeroed, as a constructor leaves it), then one load is timed:

* ``ucpformat.torch.load(path, model=m)``, the default (staged: a failed load changes
  nothing) and with ``in_place=True``;
* ``ucpformat.torch.load_state_dict(path)`` (new tensors; the model is built all the same,
  so every process holds the same memory before its load);
* DCP's ``load`` into the model's state dict (``FileSystemReader``);
* ``torch.load(path, weights_only=True)``.

**cold**: the checkpoint's pages dropped from the page cache before the process starts;
**warm**: in the page cache (read by the load before). Each process also reports the
system time and page faults of its load (``getrusage``), which say where the time went.
Round robin over repetitions, median per method.
"""

from __future__ import annotations

import os
import resource
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks import Table, common
from benchmarks import state as synthetic

DEFAULT_SIZE_MIB = 2048
QUICK_SIZE_MIB = 16
METHODS = ("staged", "in_place", "load_state_dict", "dcp", "torch")
LABELS = {
    "staged": "`ucpformat.torch.load(model=)`, staged (the default)",
    "in_place": "`ucpformat.torch.load(model=, in_place=True)`",
    "load_state_dict": "`ucpformat.torch.load_state_dict` (new tensors)",
    "dcp": "DCP `load` into the model's state dict",
    "torch": "`torch.load`",
}


def child(method: str, size_mib: str, ucp_path: str, dcp_path: str,
          torch_path: str) -> dict[str, Any]:
    """In a fresh process: build the model, time one load of ``method``."""
    warnings.filterwarnings("ignore")
    import torch

    import ucpformat.torch as ucpt

    types = {"bfloat16": torch.bfloat16, "float32": torch.float32}
    shapes = {d.name: torch.zeros(d.shape, dtype=types[d.dtype])
              for d in synthetic.tensors(float(size_mib))}
    model = common.buffer_module(shapes)
    del shapes
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if method in ("staged", "in_place"):
        ucpt.load(ucp_path, model=model, in_place=method == "in_place")
        result: Any = None
    elif method == "load_state_dict":
        result = ucpt.load_state_dict(ucp_path)
    elif method == "dcp":
        import torch.distributed.checkpoint as dcp

        result = model.state_dict()
        dcp.load(result, storage_reader=dcp.FileSystemReader(dcp_path))
    elif method == "torch":
        result = torch.load(torch_path, weights_only=True)
    else:
        raise ValueError(method)
    seconds = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    del result
    return {"seconds": seconds, "sys": after.ru_stime - before.ru_stime,
            "user": after.ru_utime - before.ru_utime,
            "faults": after.ru_minflt - before.ru_minflt}


def measure(size_mib: float, repeats: int, root: Path,
            methods: tuple[str, ...] = METHODS) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp

    import ucpformat.torch as ucpt

    state = synthetic.make(size_mib)
    paths = {"ucp": str(root / "ucp"), "dcp": str(root / "dcp"), "torch": str(root / "pt")}
    ucpt.save(paths["ucp"], model=common.buffer_module(state), durable=False)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(paths["dcp"], sync_files=False))
    torch.save(state, paths["torch"])
    nbytes = sum(t.nbytes for t in state.values())  # type: ignore[attr-defined]
    del state
    file_of = {"staged": "ucp", "in_place": "ucp", "load_state_dict": "ucp", "dcp": "dcp",
               "torch": "torch"}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        kind: {m: [] for m in methods} for kind in ("cold", "warm")}
    for r in range(repeats):
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for method in order:
            for kind in ("cold", "warm"):
                if kind == "cold":
                    common.evict(paths[file_of[method]])
                runs[kind][method].append(common.run_child(
                    "benchmarks.bench_resume:child", method, str(size_mib), paths["ucp"],
                    paths["dcp"], paths["torch"]))
    return {"size_mib": size_mib, "nbytes": nbytes, "repeats": repeats, "runs": runs,
            "methods": methods,
            "load_average": common.load_average()}


def tables(m: dict[str, Any]) -> list[Table]:
    med = statistics.median
    runs = m["runs"]

    def median_of(kind: str, method: str, field: str) -> float:
        return float(med(r[field] for r in runs[kind][method]))

    t = Table(
        title=f"A resume: one load into a new process's model, {m['nbytes'] / 2**30:.2f} GiB",
        columns=["load", "cold s", "cold × load_state_dict", "cold × DCP", "warm s",
                 "warm × load_state_dict", "warm × DCP", "warm CPU s",
                 "warm CPU × load_state_dict", "warm sys s", "warm page faults"],
    )
    for kind in ("cold", "warm"):
        for method in m["methods"]:
            for r in runs[kind][method]:
                r["cpu"] = r["user"] + r["sys"]
    data: dict[str, dict[str, float]] = {}
    for method in m["methods"]:
        cold, warm = median_of("cold", method, "seconds"), median_of("warm", method, "seconds")
        cpu = median_of("warm", method, "cpu")
        ratios = {f"{kind}_over_{base}": median_of(kind, base, "seconds") / s
                  for kind, s in (("cold", cold), ("warm", warm))
                  for base in ("load_state_dict", "dcp") if base in runs[kind]}
        if "load_state_dict" in runs["warm"]:
            ratios["warm_cpu_over_load_state_dict"] = median_of(
                "warm", "load_state_dict", "cpu") / cpu
        data[method] = {"cold_s": cold, "warm_s": warm, "warm_cpu_s": cpu, **ratios}
        t.rows.append([
            LABELS[method], f"{cold:.2f}", _ratio(ratios, "cold_over_load_state_dict"),
            _ratio(ratios, "cold_over_dcp"), f"{warm:.2f}",
            _ratio(ratios, "warm_over_load_state_dict"), _ratio(ratios, "warm_over_dcp"),
            f"{cpu:.2f}", _ratio(ratios, "warm_cpu_over_load_state_dict"),
            f"{median_of('warm', method, 'sys'):.2f}",
            f"{median_of('warm', method, 'faults'):,.0f}"])
    t.notes += [
        synthetic.describe(m["size_mib"]),
        f"median of {m['repeats']} round-robin repetitions, each load in a fresh process "
        "after building the model (zeroed memory); '×' columns: throughput ratios (the "
        "other's time / this one's: above 1 is faster)",
        "cold: the checkpoint's pages dropped from the page cache before the process "
        "started; warm: in the page cache; CPU: the load's user + system time, all its "
        "threads (what it costs the machine; steadier than wall time on a busy one)",
        f"load average (1/5/15 min) at the end: {m['load_average']}",
    ]
    t.data = data
    return [t]


def _ratio(ratios: dict[str, float], key: str) -> str:
    return f"{ratios[key]:.2f}" if key in ratios else ""


def run(quick: bool = False, *, size_mib: float | None = None, repeats: int | None = None,
        directory: Path | None = None, methods: tuple[str, ...] = METHODS) -> list[Table]:
    size = size_mib if size_mib is not None else (QUICK_SIZE_MIB if quick else DEFAULT_SIZE_MIB)
    reps = repeats if repeats is not None else (1 if quick else 5)
    with tempfile.TemporaryDirectory(prefix="ucp-bench-resume-", dir=directory) as tmp:
        return tables(measure(size, reps, Path(tmp), methods))


if __name__ == "__main__":  # pragma: no cover
    for table in run(os.environ.get("QUICK") == "1"):
        print(table.to_markdown())
