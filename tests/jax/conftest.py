"""JAX tests run on 8 virtual CPU devices: XLA reads the flag when JAX first starts its
backend, so it is set here, before any test module imports jax."""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import importlib.util  # noqa: E402

if importlib.util.find_spec("jax") is None or importlib.util.find_spec("optax") is None:
    # the jax extra is not installed (`make test` installs it): these tests cannot run
    collect_ignore_glob = ["test_*.py"]
