"""The pure geometry of parallel layouts: boxes, layout semantics, which part each rank
holds, rule files, ZeRO flat partitions, DTensor placements (no I/O, no torch).
"""
