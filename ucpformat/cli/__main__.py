"""``python -m ucpformat.cli``: the ``ucp`` command."""

import sys

from ucpformat.cli import main

sys.exit(main())
