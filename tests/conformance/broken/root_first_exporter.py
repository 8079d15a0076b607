"""Broken: the root zarr.json is written first, in place (no temporary file, no rename).

A failed save then leaves a root behind: the suite must report UCP-1.0-R050 and R054.
"""

import sys

from _load import adapter

exporter = adapter("zarr_exporter")
exporter.OPTIONS["root_last"] = False
sys.exit(exporter.main(sys.argv[1:]))
