"""One of two jax.distributed processes (4 CPU devices each) of test_multiprocess.py.

``python -m tests.jax.mp_worker <process id> <port> <dir>``: saves the test state from
a (2, 4) mesh over both processes to ``<dir>/mp``; loads ``<dir>/single`` (saved by one
process on 8 devices) onto a (4, 2) mesh, checking every local shard and that it asked
for less than the whole; then a save in which process 1 fails. Writes what it found to
``<dir>/result-<id>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"


def main(pid: int, port: int, root: str) -> dict[str, Any]:
    import jax

    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    import numpy as np

    import ucpformat
    import ucpformat.jax as ucpj
    from tests.jax.helpers import abstract, host, host_state, mesh, sharded_state

    out: dict[str, Any] = {"devices": len(jax.devices()), "local": len(jax.local_devices())}
    # 1. save from both processes
    state = sharded_state(mesh("2x4"))
    result = ucpj.save(f"{root}/mp", state, step=9)
    out["saved_bytes"] = result.bytes_written_here

    # 2. load what one process saved onto a mesh over both processes
    m = mesh("4x2")
    target = {**abstract(host_state(), m, rotate=5), "step": 0}
    ckpt = ucpformat.open_checkpoint(f"{root}/single")
    requested: list[Any] = []
    read_regions = ckpt.read_regions

    def recording(regions: Any) -> Any:
        requested.extend(regions)
        return read_regions(regions)

    ckpt.read_regions = recording  # type: ignore[method-assign]
    got = ucpj.load(ckpt, target)
    expected = host_state()
    mismatched = []
    for (path, e), g in zip(jax.tree_util.tree_flatten_with_path(expected)[0],
                            jax.tree_util.tree_leaves({k: got[k] for k in expected}),
                            strict=True):
        e = host(e)
        if not isinstance(e, np.ndarray):
            continue
        if not hasattr(g, "addressable_shards"):
            mismatched.append(f"{jax.tree_util.keystr(path)}: not an array")
            continue
        if jax.dtypes.issubdtype(g.dtype, jax.dtypes.prng_key):
            g = jax.random.key_data(g)
        for shard in g.addressable_shards:
            if np.asarray(shard.data).tobytes() != e[shard.index].tobytes():
                mismatched.append(jax.tree_util.keystr(path))
    out["mismatched"] = mismatched
    out["step"] = got["step"]
    out["requested"] = sum(int(np.prod([b - a for a, b in zip(r.starts, r.stops, strict=True)]))
                           for r in requested)
    out["elements"] = sum(int(np.prod(ckpt[p].shape)) for p in ckpt)

    # 3. process 1 fails while its values are copied: nothing is committed anywhere
    if pid == 1:
        save_module = sys.modules["ucpformat.jax.save"]

        def broken(self: Any) -> Any:
            raise RuntimeError("injected failure on process 1")

        save_module._FromDevice.__call__ = broken  # type: ignore[method-assign]
    for name, kwargs in (("fail", {}), ("mp", {"overwrite": True})):
        try:
            ucpj.save(f"{root}/{name}", state, step=10, **kwargs)
            out[f"failed_save_{name}"] = "committed"
        except Exception as exc:
            out[f"failed_save_{name}"] = f"{type(exc).__name__}: {exc}"
    jax.distributed.shutdown()
    return out


if __name__ == "__main__":
    pid, port, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    try:
        found = main(pid, port, root)
    except BaseException:
        found = {"error": traceback.format_exc()}
    with open(f"{root}/result-{pid}.json", "w") as f:
        json.dump(found, f)
