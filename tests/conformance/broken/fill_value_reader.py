"""Broken: a generic zarr reader, which reads missing chunks as fill values.

The tensorstore reader without its chunk-presence checks. The suite must report
UCP-1.0-R031 (a missing chunk is an error, never fill values).
"""

import sys

from _load import adapter

reader = adapter("tensorstore_reader")
reader.Checkpoint.check_present = lambda self, path, lo, hi: None
sys.exit(reader.main(sys.argv[1:]))
