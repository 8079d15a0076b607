"""The named checks of the suite, and the requirements each one verifies.

Every MUST requirement of the spec is verified by at least one invalid case or one of
these checks (conformance/coverage.json; tests/conformance/test_coverage.py). A check id
is ``<suite>.<name>``; results of the suites carry these ids, so a report says which
requirement failed and through which check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CheckInfo:
    id: str
    title: str
    requirements: tuple[str, ...]

    @property
    def suite(self) -> str:
        return self.id.split(".", 1)[0]


def _r(*numbers: int) -> tuple[str, ...]:
    return tuple(f"UCP-1.0-R{n:03d}" for n in numbers)


CHECKS: dict[str, CheckInfo] = {
    c.id: c
    for c in (
        # reader suite
        CheckInfo("reader.capabilities", "the adapter describes itself", _r(203, 230)),
        CheckInfo("reader.contract", "one case through the single-case command line",
                  _r(231, 235)),
        CheckInfo("reader.valid", "every valid case read bit for bit", _r(210, 211, 241)),
        CheckInfo("reader.invalid",
                  "every invalid case of stage open or read refused with an error, in time",
                  _r(97, 98, 99, 212, 213)),
        CheckInfo("reader.unsupported-types",
                  "tensors of a data type the reader declares unsupported are refused by name",
                  _r(92, 203)),
        CheckInfo("reader.layout", "local tensors of target layouts, and refused targets",
                  _r(104, 110, 111, 112, 113, 215)),
        # writer suite
        CheckInfo("writer.capabilities", "the adapter describes itself", _r(203, 230)),
        CheckInfo("writer.valid", "the checkpoint of every scenario validates, deep",
                  _r(63, 220, 233)),
        CheckInfo("writer.contents", "exact tensors, names, values and metadata",
                  _r(10, 20, 30, 80, 221, 240)),
        CheckInfo("writer.layout", "local tensors consolidated; loadable into other layouts",
                  _r(100, 113, 222)),
        CheckInfo("writer.dtensor", "DTensor placements consolidated", _r(114, 222)),
        CheckInfo("writer.coverage", "a tensor no rank fully holds is refused before writing",
                  _r(131,)),
        CheckInfo("writer.one-write-per-object",
                  "no stored object is written twice (watched with inotify)", _r(130,)),
        CheckInfo("writer.fault-data",
                  "a writer that cannot write a stored object does not commit", _r(50, 132)),
        CheckInfo("writer.fault-root",
                  "a root zarr.json cut short by a failing write is never left behind",
                  _r(54,)),
        CheckInfo("writer.existing",
                  "a committed checkpoint at the destination is kept whole or replaced whole",
                  _r(53,)),
        # validator suite
        CheckInfo("validator.capabilities", "the adapter describes itself", _r(203, 230)),
        CheckInfo("validator.cases",
                  "every case judged as its expected.json says, in time (huge grids included)",
                  _r(95, 97, 234, 250, 251)),
        # claims
        CheckInfo("suite.claim", "which claim of conformance the results support",
                  _r(200, 201, 202, 204)),
    )
}


__all__ = ["CHECKS", "CheckInfo"]
