"""Broken: zarr-python's default write_empty_chunks=False, so all-zero chunks are never written.

The suite must report UCP-1.0-R030 (writers store every chunk).
"""

import sys

from _load import adapter

exporter = adapter("zarr_exporter")
exporter.OPTIONS["write_empty_chunks"] = False
sys.exit(exporter.main(sys.argv[1:]))
