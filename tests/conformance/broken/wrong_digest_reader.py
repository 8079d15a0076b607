"""Broken: digests of the Fortran-order bytes (a column-major reader's classic slip).

The tensorstore reader with its digest function replaced. The suite must report
UCP-1.0-R210 (tensors read bit for bit, in C order).
"""

import hashlib
import sys

import numpy as np
from _load import adapter

reader = adapter("tensorstore_reader")
reader.digest = lambda array: hashlib.sha256(
    np.asfortranarray(array).tobytes(order="F")).hexdigest()
sys.exit(reader.main(sys.argv[1:]))
