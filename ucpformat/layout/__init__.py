"""The pure geometry of parallel layouts: boxes, layout semantics, which part each rank
holds, rule files, ZeRO flat partitions, DTensor placements (no I/O, no torch).
"""

from typing import Any


def __getattr__(name: str) -> Any:
    from ucpformat.compat import moved_attribute  # the modules that moved in 0.2

    return moved_attribute(__name__, name)
