"""Broken: every array is written twice (each stored object rewritten a moment later).

The suite must report UCP-1.0-R130 (one writer per stored object, written once, whole).
"""

import sys

from _load import adapter

exporter = adapter("zarr_exporter")
exporter.OPTIONS["rewrite"] = True
sys.exit(exporter.main(sys.argv[1:]))
