"""JAX: ucpformat.jax against Orbax (StandardCheckpointer and ocp.v1), same pytree.

A pytree of float32 parameters and their Adam moments (``size_mib`` in all) laid out on a
(2, 4) mesh of 8 virtual CPU devices with several PartitionSpecs. Round-robin, in one
process (a child started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``):

* **save**: ``ucpformat.jax.save`` vs ``StandardCheckpointer().save`` + ``wait_until_finished``
  vs ``ocp.v1.save``; the throughput is the pytree's bytes over the time;
* **blocked by an async save**: the time until ``ucpformat.jax.save_async`` returns (its
  device-to-host copy) vs ``StandardCheckpointer().save`` (async: it returns once its
  copy is taken) vs ``ocp.v1.save_async``; then each is waited for;
* **restore onto another mesh**: a (4, 2) mesh with other PartitionSpecs, cold (the
  checkpoint's pages dropped from the page cache first): ``ucpformat.jax.load`` vs
  ``StandardCheckpointer().restore`` vs ``ocp.v1.load``, and the bytes read then
  (``rchar`` of /proc/self/io: every byte the process read) over the pytree's bytes:
  the read amplification; and the restore's CPU time (user and system, every thread
  of the process: what it costs a machine, and a figure that a busy machine disturbs
  far less than the wall-clock time).

Medians over repetitions after one warm-up; the methods' order rotates from one
repetition to the next (``repeats`` a multiple of 3 runs each method in each place
equally often).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import Table, common

METHODS = ("ucpformat", "orbax-standard", "orbax-v1")


def _child(size_mib: int, repeats: int, root: str) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import ucpformat
    import ucpformat.jax as ucpj

    devices = np.array(jax.devices())
    save_mesh = Mesh(devices.reshape(2, 4), ("a", "b"))
    load_mesh = Mesh(devices.reshape(4, 2), ("a", "b"))
    specs = [P("a", "b"), P(("a", "b")), P(None, "b"), P(), P("b", "a"), P(("b", "a"))]
    load_specs = [P("b"), P("a", "b"), P(("a", "b")), P(None, "a"), P(), P("b", "a")]
    n = 12
    rows = max(8, (size_mib << 20) // (3 * n * 1024 * 4) // 8 * 8)

    def make(shape: tuple[int, ...], sharding: Any, seed: int) -> Any:
        host = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
        return jax.make_array_from_callback(shape, sharding, lambda index: host[index])

    def fresh(rep: int) -> dict[str, Any]:
        params, mu, nu = {}, {}, {}
        for i in range(n):
            s = NamedSharding(save_mesh, specs[i % len(specs)])
            params[f"w{i}"] = make((rows, 1024), s, 3 * i + rep)
            mu[f"w{i}"] = make((rows, 1024), s, 3 * i + 1 + rep)
            nu[f"w{i}"] = make((rows, 1024), s, 3 * i + 2 + rep)
        import optax

        adam = optax.ScaleByAdamState(count=jnp.asarray(rep, jnp.int32), mu=mu, nu=nu)
        state = {"params": params, "opt_state": (adam, optax.EmptyState())}
        jax.block_until_ready(state)
        return state

    def abstract(state: dict[str, Any]) -> dict[str, Any]:
        counter = iter(range(10**6))

        def one(x: Any) -> Any:
            spec = load_specs[next(counter) % len(load_specs)] if x.ndim == 2 else P()
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(load_mesh, spec))

        return jax.tree_util.tree_map(one, state)

    nbytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(fresh(0)))
    results: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
    std = ocp.StandardCheckpointer()

    def record(method: str, what: str, value: float) -> None:
        results[method].setdefault(what, []).append(value)

    for rep in range(repeats + 1):
        # the order rotates: a method that always ran right after another's save and
        # clean-up was measured restoring 1.5x slower than the same method run elsewhere
        for method in METHODS[rep % len(METHODS):] + METHODS[:rep % len(METHODS)]:
            path = f"{root}/{method}-{rep}"
            state = fresh(rep)  # fresh arrays: no host copy cached on them
            t0 = time.perf_counter()
            if method == "ucpformat":
                ucpj.save(path, state)
            elif method == "orbax-standard":
                std.save(path, state)
                std.wait_until_finished()
            else:
                ocp.v1.save(path, state)
            save_s = time.perf_counter() - t0
            common.remove(path)
            state = fresh(rep + 1)
            t0 = time.perf_counter()
            if method == "ucpformat":
                future = ucpj.save_async(path, state)
                blocked = time.perf_counter() - t0
                future.result()
            elif method == "orbax-standard":
                std.save(path, state)
                blocked = time.perf_counter() - t0
                std.wait_until_finished()
            else:
                response = ocp.v1.save_async(path, state)
                blocked = time.perf_counter() - t0
                response.result()
            async_total = time.perf_counter() - t0
            target = abstract(state)
            common.evict(path)
            before = common.io_read_chars()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            if method == "ucpformat":
                restored = ucpj.load(path, target)
            elif method == "orbax-standard":
                restored = std.restore(path, target)
            else:
                restored = ocp.v1.load(path, target)
            jax.block_until_ready(restored)
            load_s = time.perf_counter() - t0
            load_cpu_s = time.process_time() - cpu0
            read = common.io_read_chars() - before
            if rep == 0:  # the warm-up checks that every method restored the same values
                want = np.asarray(state["params"]["w1"])
                got = np.asarray(restored["params"]["w1"])
                assert want.tobytes() == got.tobytes(), method
                if method == "ucpformat":
                    assert ucpformat.validate(path).valid
                continue
            record(method, "save_s", save_s)
            record(method, "blocked_s", blocked)
            record(method, "async_total_s", async_total)
            record(method, "load_s", load_s)
            record(method, "load_cpu_s", load_cpu_s)
            record(method, "read_bytes", read)
            record(method, "disk_bytes", common.disk_bytes(path))
            common.remove(path)
            del state, restored
    return {"nbytes": nbytes, "results": {
        m: {k: statistics.median(v) for k, v in r.items()} for m, r in results.items()}}


def run(quick: bool = False, size_mib: int = 256, repeats: int = 6,
        directory: str | None = None) -> list[Table]:
    """Start the child with 8 virtual devices and tabulate what it measured."""
    size = 16 if quick else size_mib
    repeats = 1 if quick else repeats
    with tempfile.TemporaryDirectory(dir=directory) as root:
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
               "JAX_PLATFORMS": "cpu"}
        out = Path(root) / "result.json"
        subprocess.run([sys.executable, "-m", "benchmarks.bench_jax", str(size), str(repeats),
                        root, str(out)], check=True, env=env,
                       cwd=Path(__file__).resolve().parents[1])
        found = json.loads(out.read_text())
    nbytes, res = found["nbytes"], found["results"]
    mib = nbytes / (1 << 20)
    table = Table(
        f"JAX: ucpformat.jax vs Orbax, {mib:.0f} MiB pytree on 8 virtual CPU devices",
        ["method", "save (MiB/s)", "blocked by async save (s)", "async save total (s)",
         "restore onto (4, 2) (s)", "restore CPU (s)", "bytes read / pytree bytes",
         "on disk (MiB)"])
    for method in METHODS:
        r = res[method]
        table.rows.append([method, f"{mib / r['save_s']:.0f}", f"{r['blocked_s']:.3f}",
                           f"{r['async_total_s']:.2f}", f"{r['load_s']:.2f}",
                           f"{r['load_cpu_s']:.2f}",
                           f"{r['read_bytes'] / nbytes:.2f}",
                           f"{r['disk_bytes'] / (1 << 20):.0f}"])
    table.notes.append(f"medians of {repeats} after a warm-up (the methods' order rotating); "
                       "saves from a (2, 4) mesh, "
                       "restores cold onto a (4, 2) mesh with other PartitionSpecs; load "
                       f"average {common.load_average()}")
    table.data = found
    return [table]


if __name__ == "__main__":
    size_arg, repeats_arg, root_arg, out_arg = sys.argv[1:5]
    result = _child(int(size_arg), int(repeats_arg), root_arg)
    Path(out_arg).write_text(json.dumps(result))
