"""The rendered specification: ``make docs`` (spec/site/build.py)."""
