"""Side-by-side measurements of ucpformat against its peers.

Each ``benchmarks/bench_*.py`` module has ``run(quick: bool) -> list[Table]``;
``python -m benchmarks.run`` (``make bench``; ``make bench-quick`` adds ``--quick``) runs
them all and writes their tables as Markdown. Timings are never asserted in tests.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class Table:
    """One result table: a title, a header, rows of cells, and notes printed under it."""

    title: str
    columns: Sequence[str]
    rows: list[Sequence[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_markdown(self) -> str:
        lines = [f"### {self.title}", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(self.columns)))
                     + "|")
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in self.rows]
        if self.notes:
            lines.append("")
            lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines) + "\n"


def side_by_side(
    cases: Mapping[str, Callable[[], object]], repeats: int, *, warmup: int = 1
) -> dict[str, list[float]]:
    """Run every case ``repeats`` times, round-robin (so drift hits all alike); seconds each."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f}"
