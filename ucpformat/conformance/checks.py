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


CHECKS: dict[str, CheckInfo] = {
    c.id: c
    for c in (
        # reader suite
        CheckInfo(
            "reader.capabilities", "the adapter describes itself", ("UCP-1.0-R203", "UCP-1.0-R230")
        ),
        CheckInfo(
            "reader.contract",
            "one case through the single-case command line",
            ("UCP-1.0-R231", "UCP-1.0-R235"),
        ),
        CheckInfo(
            "reader.valid",
            "every valid case read bit for bit",
            ("UCP-1.0-R210", "UCP-1.0-R211", "UCP-1.0-R241"),
        ),
        CheckInfo(
            "reader.invalid",
            "every invalid case of stage open or read refused with an error, in time",
            ("UCP-1.0-R097", "UCP-1.0-R098", "UCP-1.0-R099", "UCP-1.0-R212", "UCP-1.0-R213"),
        ),
        CheckInfo(
            "reader.unsupported-types",
            "tensors of a data type the reader declares unsupported are refused by name",
            ("UCP-1.0-R092", "UCP-1.0-R203"),
        ),
        CheckInfo(
            "reader.layout",
            "local tensors of target layouts, and refused targets",
            (
                "UCP-1.0-R104",
                "UCP-1.0-R110",
                "UCP-1.0-R111",
                "UCP-1.0-R112",
                "UCP-1.0-R113",
                "UCP-1.0-R215",
            ),
        ),
        # writer suite
        CheckInfo(
            "writer.capabilities", "the adapter describes itself", ("UCP-1.0-R203", "UCP-1.0-R230")
        ),
        CheckInfo(
            "writer.valid",
            "the checkpoint of every scenario validates, deep; the adapter prints nothing "
            "or a JSON object on success; zero fill values spelled out (a warning)",
            ("UCP-1.0-R033", "UCP-1.0-R063", "UCP-1.0-R220", "UCP-1.0-R233"),
        ),
        CheckInfo(
            "writer.contents",
            "exact tensors, names, values and metadata",
            (
                "UCP-1.0-R010",
                "UCP-1.0-R020",
                "UCP-1.0-R030",
                "UCP-1.0-R080",
                "UCP-1.0-R221",
                "UCP-1.0-R240",
            ),
        ),
        CheckInfo(
            "writer.layout",
            "local tensors consolidated; loadable into other layouts",
            ("UCP-1.0-R100", "UCP-1.0-R113", "UCP-1.0-R222"),
        ),
        CheckInfo(
            "writer.dtensor", "DTensor placements consolidated", ("UCP-1.0-R114", "UCP-1.0-R222")
        ),
        CheckInfo(
            "writer.coverage",
            "a tensor no rank fully holds is refused before writing",
            ("UCP-1.0-R131",),
        ),
        CheckInfo(
            "writer.one-write-per-object",
            "no stored object is written twice (watched with inotify)",
            ("UCP-1.0-R130",),
        ),
        CheckInfo(
            "writer.fault-data",
            "a writer that cannot write a stored object does not commit",
            ("UCP-1.0-R050", "UCP-1.0-R132"),
        ),
        CheckInfo(
            "writer.fault-root",
            "a root zarr.json cut short by a failing write is never left behind",
            ("UCP-1.0-R054",),
        ),
        CheckInfo(
            "writer.existing",
            "a committed checkpoint at the destination is kept whole or replaced whole",
            ("UCP-1.0-R053",),
        ),
        CheckInfo(
            "writer.stray",
            "a committed checkpoint beside a file no checkpoint has: a refusal changes nothing, "
            "a save removes the file",
            ("UCP-1.0-R049", "UCP-1.0-R066"),
        ),
        CheckInfo(
            "writer.concurrent",
            "two writers whose runs overlap (the first stopped once it claims): one "
            "checkpoint, never both, never mixed",
            ("UCP-1.0-R059", "UCP-1.0-R064", "UCP-1.0-R065"),
        ),
        # validator suite
        CheckInfo(
            "validator.capabilities",
            "the adapter describes itself",
            ("UCP-1.0-R203", "UCP-1.0-R230"),
        ),
        CheckInfo(
            "validator.cases",
            "every case judged as its expected.json says, in time (huge grids included)",
            ("UCP-1.0-R095", "UCP-1.0-R097", "UCP-1.0-R234", "UCP-1.0-R250", "UCP-1.0-R251"),
        ),
        # claims
        CheckInfo(
            "suite.claim",
            "which claim of conformance the results support",
            ("UCP-1.0-R200", "UCP-1.0-R201", "UCP-1.0-R202", "UCP-1.0-R204"),
        ),
    )
}


__all__ = ["CHECKS", "CheckInfo"]
