"""``python -m ucpformat.conformance ...``: the same as ``ucp conformance ...``."""

import sys

from ucpformat.conformance.command import main

sys.exit(main())
