"""Run every benchmark (``benchmarks/bench_*.py``) and write a Markdown report and a chart.

A benchmark module has ``run(quick: bool, ...)`` returning a list of
:class:`benchmarks.Table` or a list of row dicts (printed as one table titled by the
module's first doc line). Modules whose ``run`` takes ``size_mib`` get ``--size-mib``.

    python -m benchmarks.run [--quick] [--only NAME ...] [--size-mib N] [--output FILE]
                             [--chart PNG] [--doc BENCHMARKS.md] [--wait-load 1.5]

``--doc`` replaces the part of that file between ``<!-- results:begin -->`` and
``<!-- results:end -->`` with the report (the rest of the file is written by people).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import os
import pkgutil
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import benchmarks
from benchmarks import Table

#: Modules run first, in this order; any other bench_* module after them, by name.
ORDER = ["bench_throughput", "bench_resume", "bench_distributed", "bench_memory", "bench_open",
         "bench_flat", "bench_validate", "bench_async", "bench_training", "bench_reshard",
         "bench_tuning", "bench_compression", "bench_import", "bench_deepspeed", "bench_megatron",
         "bench_staging", "bench_gpu", "bench_gpu_deepspeed", "bench_jax"]
#: Modules a quick run leaves out (each starts several processes or needs a large state).
SLOW = {"bench_resume", "bench_async", "bench_training", "bench_reshard", "bench_tuning",
        "bench_compression", "bench_memory", "bench_import", "bench_deepspeed", "bench_megatron",
        "bench_gpu", "bench_gpu_deepspeed", "bench_jax"}
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"


def discover() -> list[str]:
    """Names of the benchmark modules, in running order (``bench_throughput``, ...)."""
    found = {m.name for m in pkgutil.iter_modules(benchmarks.__path__)
             if m.name.startswith("bench_")}
    return [n for n in ORDER if n in found] + sorted(found - set(ORDER))


def as_tables(result: Any, module: ModuleType) -> list[Table]:
    """A benchmark's result as tables: a list of Tables, or a list of row dicts (one table)."""
    items = list(result)
    if all(isinstance(t, Table) for t in items):
        return items
    if all(isinstance(r, dict) for r in items):
        title = (module.__doc__ or module.__name__).strip().splitlines()[0].rstrip(".")
        columns = list(items[0]) if items else []
        return [Table(title, columns, [[str(r.get(c, "")) for c in columns] for r in items])]
    raise TypeError(f"{module.__name__}.run must return Tables or row dicts")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _memory_gib() -> str:
    try:
        return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB"
    except (ValueError, OSError):
        return "unknown"


def _filesystem(path: str) -> str:
    try:
        best = ("", "")
        with open("/proc/mounts") as f:
            for line in f:
                dev, mount, fstype = line.split()[:3]
                if path.startswith(mount) and len(mount) > len(best[0]):
                    best = (mount, f"{fstype} on {dev}")
        return best[1] or "unknown"
    except OSError:
        return "unknown"


def environment() -> str:
    """The machine and the software, one line."""
    import numpy
    import zarr

    import ucpformat

    versions = [f"Python {platform.python_version()}", f"ucpformat {ucpformat.__version__}",
                f"zarr {zarr.__version__}", f"numpy {numpy.__version__}"]
    try:
        import torch

        versions.append(f"torch {torch.__version__}")
    except ImportError:  # pragma: no cover
        pass
    import tempfile

    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {_cpu_model()}, "
        f"{os.cpu_count()} CPUs, {_memory_gib()} RAM · {platform.system()} "
        f"{platform.release()} · scratch: {_filesystem(tempfile.gettempdir())} · "
        + " · ".join(versions)
    )


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover
        return 0.0


def wait_for_quiet(threshold: float, limit_s: float) -> float:
    """Sleep until the 1-minute load average is below ``threshold`` (or ``limit_s``
    passes); the load average then."""
    deadline = time.monotonic() + limit_s
    while load_average() >= threshold and time.monotonic() < deadline:
        print(f"load average {load_average():.2f} >= {threshold}: waiting", file=sys.stderr,
              flush=True)
        time.sleep(30)
    return load_average()


def chart(tables: Sequence[Table], path: Path) -> bool:
    """A PNG of the throughput and distributed figures; False if there are none."""
    tp = next((t for t in tables if "rows" in t.data and "nbytes" in t.data), None)
    dist = next((t for t in tables if "dist" in t.data), None)
    if tp is None and dist is None:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [x for x in (tp, dist) if x is not None]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4.6), squeeze=False)
    if tp is not None:
        ax = axes[0][0]
        rows: dict[str, dict[str, float]] = tp.data["rows"]
        gib = tp.data["nbytes"] / 2**30
        names = list(rows)
        kinds = [("save_s", "save (durable)"), ("cold_s", "load, cold"),
                 ("warm_s", "load, warm")]
        width = 0.27
        for i, (key, label) in enumerate(kinds):
            values = [gib / rows[n][key] if key in rows[n] else 0.0 for n in names]
            ax.barh([y + (i - 1) * width for y in range(len(names))], values, height=width,
                    label=label)
        ax.set_yticks(range(len(names)), [n.replace("ucpformat ", "ucp ") for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("GiB/s (higher is better)")
        ax.set_title(f"One process, {gib:.2f} GiB state")
        ax.legend(loc="lower right", fontsize=8)
    if dist is not None:
        ax = axes[0][len(panels) - 1]
        d: dict[str, tuple[float, float]] = dist.data["dist"]
        labels = list(d)
        width = 0.38
        ax.barh([y - width / 2 for y in range(len(labels))], [d[k][0] for k in labels],
                height=width, label="DCP")
        ax.barh([y + width / 2 for y in range(len(labels))], [d[k][1] for k in labels],
                height=width, label="ucpformat")
        ax.set_yticks(range(len(labels)), labels)
        ax.invert_yaxis()
        ax.set_xlabel("seconds, slowest rank (lower is better)")
        ax.set_title("Distributed (gloo processes)")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def update_doc(doc: Path, report: str) -> None:
    """Replace the generated part of ``doc`` (between the markers) with ``report``."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else f"{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{doc} has no {BEGIN} ... {END} section to replace")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n\n{report.strip()}\n\n{END}{tail}", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="short mode: small states, one repetition, slow modules left out")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these benchmarks (e.g. open or bench_open)")
    parser.add_argument("--size-mib", type=float, default=None,
                        help="state size for the benchmarks that take one (default: theirs, "
                             "2048 for throughput, distributed and memory)")
    parser.add_argument("--output", type=Path, default=Path("out/benchmarks.md"),
                        help="Markdown report to write (default: out/benchmarks.md)")
    parser.add_argument("--chart", type=Path, default=None,
                        help="PNG chart to write (default: next to --output)")
    parser.add_argument("--doc", type=Path, default=None,
                        help="also put the report into this file's generated section")
    parser.add_argument("--wait-load", type=float, default=None, metavar="LOAD",
                        help="first wait (up to --wait-max s) for a 1-min load average below")
    parser.add_argument("--wait-max", type=float, default=1200.0)
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in args.only}
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"no such benchmark: {', '.join(sorted(unknown))} (have {names})")
        names = [n for n in names if n in wanted]
    elif args.quick:
        names = [n for n in names if n not in SLOW]
    if args.wait_load is not None:
        wait_for_quiet(args.wait_load, args.wait_max)
    mode = "quick" if args.quick else "full"
    started_load = load_average()
    sections = [f"# ucpformat benchmarks ({mode})", "", environment(), "",
                f"Load average (1 min) at the start: {started_load:.2f}.", ""]
    all_tables: list[Table] = []
    data: dict[str, Any] = {}
    for name in names:
        print(f"running {name} ({mode}) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        module = importlib.import_module(f"benchmarks.{name}")
        kwargs: dict[str, Any] = {}
        if args.size_mib is not None and "size_mib" in inspect.signature(module.run).parameters:
            kwargs["size_mib"] = args.size_mib
        for table in as_tables(module.run(quick=args.quick, **kwargs), module):
            table.notes.append(f"{name}: {time.perf_counter() - started:.1f} s in all")
            text = table.to_markdown()
            print(text, flush=True)
            sections.append(text)
            all_tables.append(table)
            if table.data:
                data[table.title] = table.data
    sections.append(f"Load average (1 min) at the end: {load_average():.2f}.\n")
    report = "\n".join(sections)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report, encoding="utf-8")
    args.output.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    chart_path = args.chart or args.output.with_suffix(".png")
    if chart(all_tables, chart_path):
        print(f"chart written to {chart_path}", file=sys.stderr)
    if args.doc is not None:
        update_doc(args.doc, report.split("\n", 2)[2])  # the doc has its own title
        print(f"{args.doc} updated", file=sys.stderr)
    print(f"report written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
