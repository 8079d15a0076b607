"""Version of the reference implementation (not of the format; see ucpformat.FORMAT_VERSION)."""

__version__ = "0.1.0"
