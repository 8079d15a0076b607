"""Optional dependencies: imported on use, and when missing, an error naming the extra.

``pip install ucpformat`` brings numpy and zarr only; torch (``[torch]``, ``[import]``)
and fsspec with s3fs (``[s3]``) come with extras. A missing one is a
:class:`~ucpformat.errors.MissingDependencyError` that says what to install, never a bare
``ModuleNotFoundError``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ucpformat.errors import MissingDependencyError


def require(module: str, *, extra: str, purpose: str) -> ModuleType:
    """``import module``, or a MissingDependencyError: ``<purpose> needs <module>: pip
    install 'ucpformat[<extra>]'``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{purpose} needs {module.partition('.')[0]}, which is not installed: pip install "
            f"'ucpformat[{extra}]' ({exc})"
        ) from exc
