"""``python -m ucpformat.importers convert|export ...`` (the same as ``ucp convert|export``)."""

from ucpformat.importers.cli import main

raise SystemExit(main())
