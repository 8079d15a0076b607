"""Teach zarr-python ucpformat's data types (bfloat16, float8) without importing ucpformat.

zarr-python 3.1 and 3.2 collect the ``zarr.data_type`` entry points that packages
declare, but never load them (``data_type_registry._lazy_load()`` is never called), so
plain ``zarr.open_group(ckpt)`` fails on a bfloat16 array with "No Zarr data type found
that matches 'bfloat16'". ucpformat's wheel ships this module and a ``.pth`` file that
imports it when Python starts. It costs one small module: it only asks to be told when
``zarr`` is imported. Then, for each data type that ucpformat's entry points declare
and zarr does not know, it registers a stand-in under that name; the first stand-in that
zarr asks about a data type imports ``ucpformat.format.zarr_dtypes``, which replaces every
stand-in with the real class (in place: zarr may be iterating over its registry), and
answers with its own class. An interpreter that never meets such a data type never
imports ucpformat. A failure here never stops zarr, or Python, from starting.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False  # typing is not imported at start-up (mypy takes this name as True)
if TYPE_CHECKING:
    from typing import Any

#: The entry-point values of ucpformat's data types start with this.
PLUGIN_MODULE = "ucpformat.format.zarr_dtypes"


class LazyDataType:
    """Stands in zarr's data type registry for one of ucpformat's types until needed."""

    name = ""

    @classmethod
    def _real(cls) -> Any:
        from ucpformat.format import zarr_dtypes

        zarr_dtypes.register()  # replaces every stand-in, in place
        return next(p for p in zarr_dtypes.PLUGINS if p._zarr_v3_name == cls.name)

    @classmethod
    def from_json(cls, data: Any, *, zarr_format: Any) -> Any:
        name = data.get("name") if isinstance(data, dict) else data
        if name != cls.name:
            from zarr.core.dtype.common import DataTypeValidationError

            raise DataTypeValidationError(f"{data!r} is not {cls.name}")
        return cls._real().from_json(data, zarr_format=zarr_format)

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> Any:
        if getattr(dtype, "name", None) != cls.name:
            from zarr.core.dtype.common import DataTypeValidationError

            raise DataTypeValidationError(f"{dtype!r} is not {cls.name}")
        return cls._real().from_native_dtype(dtype)


def register() -> None:
    """Stand-ins for ucpformat's declared data types that zarr does not know."""
    from zarr.core.dtype import data_type_registry

    for entry in list(getattr(data_type_registry, "_lazy_load_list", [])):
        name = getattr(entry, "name", "")
        if str(getattr(entry, "value", "")).startswith(PLUGIN_MODULE + ":") and name \
                and name not in data_type_registry.contents:
            stand_in = type(f"LazyDataType_{name}", (LazyDataType,), {"name": name})
            data_type_registry.register(name, stand_in)


class ZarrImportHook:
    """Finds nothing itself: when ``zarr`` is imported, it lets the other finders find it
    and runs :func:`register` once zarr's own module has run."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != "zarr":
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]  # once
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        exec_module = getattr(spec.loader, "exec_module", None)
        if exec_module is None:
            return spec

        def run_then_register(module: Any) -> None:
            exec_module(module)
            try:  # noqa: SIM105 - contextlib is not imported at startup
                register()
            except Exception:  # never let this break an import of zarr
                pass

        spec.loader.exec_module = run_then_register  # this loader instance only (zarr's)
        return spec


def install() -> None:
    """Register now if zarr is already imported, else when it is."""
    if "zarr" in sys.modules:
        register()
    elif not any(isinstance(f, ZarrImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, ZarrImportHook())


try:  # noqa: SIM105 - contextlib is not imported at startup
    install()
except Exception:  # a .pth import must never stop Python from starting
    pass
