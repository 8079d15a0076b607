"""Run every benchmark (``benchmarks/bench_*.py``) and write a Markdown report.

A benchmark module has ``run(quick: bool)`` returning a list of :class:`benchmarks.Table`
or a list of row dicts (printed as one table titled by the module's first doc line).

    python -m benchmarks.run [--quick] [--only NAME ...] [--output FILE]
"""

from __future__ import annotations

import argparse
import datetime
import importlib
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


def discover() -> list[str]:
    """Names of the benchmark modules, sorted (``bench_open``, ...)."""
    return sorted(
        m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith("bench_")
    )


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


def environment() -> str:
    import numpy
    import zarr

    import ucpformat

    return (
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · {platform.platform()} · "
        f"{os.cpu_count()} CPUs · Python {platform.python_version()} · "
        f"ucpformat {ucpformat.__version__} · zarr {zarr.__version__} · numpy {numpy.__version__}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short mode: fewer repeats")
    parser.add_argument("--only", nargs="+", metavar="NAME",
                        help="run only these benchmarks (e.g. open or bench_open)")
    parser.add_argument("--output", type=Path, default=Path("out/benchmarks.md"),
                        help="Markdown report to write (default: out/benchmarks.md)")
    args = parser.parse_args(argv)
    names = discover()
    if args.only:
        wanted = {n if n.startswith("bench_") else f"bench_{n}" for n in args.only}
        unknown = wanted - set(names)
        if unknown:
            parser.error(f"no such benchmark: {', '.join(sorted(unknown))} (have {names})")
        names = [n for n in names if n in wanted]
    mode = "quick" if args.quick else "full"
    sections = [f"# ucpformat benchmarks ({mode})", "", environment(), ""]
    for name in names:
        print(f"running {name} ({mode}) ...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        module = importlib.import_module(f"benchmarks.{name}")
        for table in as_tables(module.run(quick=args.quick), module):
            table.notes.append(f"{name}: {time.perf_counter() - started:.1f} s in all")
            text = table.to_markdown()
            print(text)
            sections.append(text)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("\n".join(sections), encoding="utf-8")
    print(f"report written to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
