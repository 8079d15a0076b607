"""``ucp demo --framework jax``: the universal-checkpointing experiment in JAX, on CPU.

The torch demo's small GPT (:mod:`ucpformat.torch.demo`: token and position embeddings,
pre-LayerNorm blocks of causal attention and a GELU MLP, an untied head; AdamW with
weight decay 0.1, warm-up then cosine learning rate; the same synthetic Markov corpus
and batches), written in JAX with the parameters named as torch names them, trained on
8 virtual CPU devices on a (2, 4) mesh (data x model: attention heads and MLP columns
split over ``model``, the batch over ``data``). Run A trains every step and saves a UCP
checkpoint half-way (``ucpformat.jax.save_async``); runs B resume it on a (4, 2) and a
(1, 8) mesh with other PartitionSpecs (``ucpformat.jax.load`` onto ShapeDtypeStructs);
the control resumes the parameters without the optimizer state. Each resumed run's
losses must follow run A's within ``--rtol``; the control must not. A table, a CSV and a
PNG plot (with matplotlib) go to ``--out``.

:func:`cross` is JAX's half of the experiment across frameworks (``ucp demo --framework
cross``, :mod:`ucpformat.cli.cross_demo`): it resumes a PyTorch run's checkpoint of the
same GPT and saves one that PyTorch resumes.

Needs 8 devices: the command restarts itself in a child process with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (:func:`child_env`) unless JAX
already has them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ucpformat.errors import LoadError
from ucpformat.optional import require

#: Relative tolerance of a resumed run's losses against run A's (float32 sums in another
#: order on another mesh: measured about 1e-6).
DEFAULT_RTOL = 1e-4


@dataclass(frozen=True)
class Config:
    """The torch demo's defaults (:class:`ucpformat.torch.demo.Config`)."""

    vocab: int = 64
    seq_len: int = 32
    dim: int = 64
    heads: int = 4
    layers: int = 2
    batch: int = 16
    steps: int = 150
    save_at: int = 75
    lr: float = 1.5e-3
    warmup: int = 5
    seed: int = 0


QUICK = Config(dim=32, layers=1, batch=8, steps=12, save_at=6)


def corpus(cfg: Config, length: int = 1 << 16) -> np.ndarray[Any, Any]:
    """The torch demo's corpus: a sparse random Markov chain over the vocabulary."""
    rng = np.random.default_rng(1234)
    successors = rng.integers(0, cfg.vocab, size=(cfg.vocab, 4))
    choice = rng.choice(4, size=length, p=np.array([0.4, 0.3, 0.2, 0.1]))
    out = np.empty(length, dtype=np.int64)
    out[0] = 0
    for i in range(1, length):
        out[i] = successors[out[i - 1], choice[i]]
    return out


def global_batch(cfg: Config, stream: np.ndarray[Any, Any], step: int) -> np.ndarray[Any, Any]:
    """The (batch, seq_len + 1) token windows of a step (the torch demo's)."""
    rng = np.random.default_rng([cfg.seed, step])
    starts = rng.integers(0, len(stream) - cfg.seq_len - 1, size=cfg.batch)
    return np.stack([stream[s : s + cfg.seq_len + 1] for s in starts]).astype(np.int32)


def schedule(cfg: Config, step: int) -> float:
    """The learning-rate factor of a step (the torch demo's LambdaLR)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def init_params(cfg: Config) -> dict[str, Any]:
    """Parameters named as the torch GPT names them; kernels (in, out) as Flax's."""
    rng = np.random.default_rng(cfg.seed)

    def dense(n_in: int, n_out: int, bias: bool = True) -> dict[str, Any]:
        bound = 1 / math.sqrt(n_in)
        out = {"kernel": rng.uniform(-bound, bound, (n_in, n_out)).astype(np.float32)}
        if bias:
            out["bias"] = rng.uniform(-bound, bound, n_out).astype(np.float32)
        return out

    def norm() -> dict[str, Any]:
        return {"scale": np.ones(cfg.dim, np.float32), "bias": np.zeros(cfg.dim, np.float32)}

    d = cfg.dim
    return {
        "tok_emb": {"embedding": rng.standard_normal((cfg.vocab, d)).astype(np.float32)},
        "pos_emb": {"embedding": rng.standard_normal((cfg.seq_len, d)).astype(np.float32)},
        "blocks": {str(i): {
            "ln1": norm(), "ln2": norm(),
            "attn": {"q": dense(d, d), "k": dense(d, d), "v": dense(d, d), "proj": dense(d, d)},
            "mlp": {"fc": dense(d, 4 * d), "out": dense(4 * d, d)},
        } for i in range(cfg.layers)},
        "ln_f": norm(),
        "head": dense(d, cfg.vocab, bias=False),
    }


def specs(cfg: Config, params: Any, transpose: bool) -> Any:
    """A PartitionSpec per parameter: tensor parallelism over ``model`` (columns of q, k,
    v and fc, rows of proj and out); ``transpose`` swaps the mesh axes' roles."""
    jax = require("jax", extra="jax", purpose="the JAX demo")
    P = jax.sharding.PartitionSpec
    model, data = ("data", "model") if transpose else ("model", "data")

    def one(path: Any, leaf: Any) -> Any:
        names = [str(getattr(p, "key", p)) for p in path]
        if names[-1] == "kernel" and names[-2] in ("q", "k", "v", "fc"):
            return P(None, model)
        if names[-1] == "bias" and names[-2] in ("q", "k", "v", "fc"):
            return P(model)
        if names[-1] == "kernel" and names[-2] in ("proj", "out"):
            return P(model, None)
        if names[-1] == "embedding":
            return P(None, (model, data))
        return P()

    return jax.tree_util.tree_map_with_path(one, params)


def forward(cfg: Config, params: Any, tokens: Any) -> Any:
    """The GPT's logits (as the torch demo computes them: exact GELU, LayerNorm eps 1e-5)."""
    jax = require("jax", extra="jax", purpose="the JAX demo")
    jnp = jax.numpy

    def norm(p: Any, x: Any) -> Any:
        mean = x.mean(-1, keepdims=True)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)
        return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]

    def dense(p: Any, x: Any) -> Any:
        return x @ p["kernel"] + p["bias"] if "bias" in p else x @ p["kernel"]

    b, t = tokens.shape
    h = cfg.heads
    x = params["tok_emb"]["embedding"][tokens] + params["pos_emb"]["embedding"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(cfg.layers):
        blk = params["blocks"][str(i)]
        y = norm(blk["ln1"], x)
        q, k, v = (dense(blk["attn"][n], y).reshape(b, t, h, -1).transpose(0, 2, 1, 3)
                   for n in ("q", "k", "v"))
        att = q @ k.transpose(0, 1, 3, 2) / math.sqrt(cfg.dim // h)
        att = jax.nn.softmax(jnp.where(mask, att, -jnp.inf), axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, -1)
        x = x + dense(blk["attn"]["proj"], y)
        y = jax.nn.gelu(dense(blk["mlp"]["fc"], norm(blk["ln2"], x)), approximate=False)
        x = x + dense(blk["mlp"]["out"], y)
    return dense(params["head"], norm(params["ln_f"], x))


def optimizer() -> Any:
    """torch's AdamW as an Optax chain (the learning rate applied outside: the schedule's
    step is the run's, as torch's LambdaLR counts it)."""
    optax = require("optax", extra="jax", purpose="the JAX demo")
    return optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1))


@functools.cache
def trainer(cfg: Config) -> Callable[[Any, Any, Any, Any], Any]:
    """The jitted training step of ``cfg`` (one per config: each run of a process on
    the same layout reuses its compilation)."""
    jax = require("jax", extra="jax", purpose="the JAX demo")
    optax = require("optax", extra="jax", purpose="the JAX demo")
    tx = optimizer()

    def loss_fn(params: Any, tokens: Any) -> Any:
        logits = forward(cfg, params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params: Any, opt_state: Any, tokens: Any, lr: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = jax.tree_util.tree_map(lambda p, u: p - lr * u, params, updates)
        return params, opt_state, loss

    jitted: Callable[[Any, Any, Any, Any], Any] = jax.jit(step)
    return jitted


def place(state: Any, shardings: Any) -> Any:
    jax = require("jax", extra="jax", purpose="the JAX demo")
    def one(x: Any, sharding: Any) -> Any:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return jax.tree_util.tree_map(one, state, shardings)


def replicated(mesh: Any) -> Any:
    jax = require("jax", extra="jax", purpose="the JAX demo")
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def layout_of(cfg: Config, params: Any, mesh_shape: tuple[int, int], transpose: bool) -> Any:
    """NamedShardings of a training state (params and Adam moments alike) on a mesh."""
    jax = require("jax", extra="jax", purpose="the JAX demo")
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "model"))
    return jax.tree_util.tree_map(lambda s: jax.sharding.NamedSharding(mesh, s),
                                  specs(cfg, params, transpose)), mesh


def train(cfg: Config, state: dict[str, Any], mesh: Any, start: int, stop: int,
          on_step: Callable[[int, dict[str, Any]], None] | None = None) -> list[float]:
    jax = require("jax", extra="jax", purpose="the JAX demo")
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    step_fn = trainer(cfg)
    stream = corpus(cfg)
    losses = []
    for step in range(start, stop):
        tokens = jax.device_put(global_batch(cfg, stream, step), batch_sharding)
        lr = np.float32(cfg.lr * schedule(cfg, step))
        state["params"], state["opt_state"], loss = step_fn(
            state["params"], state["opt_state"], tokens, lr)
        losses.append(float(loss))
        if on_step is not None:
            on_step(step + 1, state)
    return losses


def optimizer_state(params: Any, shardings: Any, mesh: Any) -> Any:
    """A fresh optimizer state laid out as the parameters (the count replicated)."""
    zero = optimizer().init(params)
    return (zero[0]._replace(count=place(zero[0].count, replicated(mesh)),
                             mu=place(zero[0].mu, shardings), nu=place(zero[0].nu, shardings)),
            *zero[1:])


def abstract_state(params: Any, shardings: Any, mesh: Any, *,
                   with_optimizer: bool = True) -> dict[str, Any]:
    """The target of a load on ``shardings``: ShapeDtypeStructs of the parameters and, with
    ``with_optimizer``, of the Adam state and the step."""
    jax = require("jax", extra="jax", purpose="the JAX demo")
    abstract = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.float32, sharding=s),
        params, shardings)
    if not with_optimizer:
        return {"params": abstract}
    zero = optimizer().init(params)
    count = jax.ShapeDtypeStruct((), np.int32, sharding=replicated(mesh))
    return {"params": abstract,
            "opt_state": (zero[0]._replace(count=count, mu=abstract, nu=abstract), *zero[1:]),
            "step": 0}


def experiment(cfg: Config, root: str) -> dict[str, Any]:
    """Run A, the resumes on (4, 2) and (1, 8), and the control; every loss curve."""
    import ucpformat.jax as ucpj

    params = init_params(cfg)
    shardings, mesh = layout_of(cfg, params, (2, 4), transpose=False)
    state = {"params": place(params, shardings),
             "opt_state": optimizer_state(params, shardings, mesh)}
    ckpt = f"{root}/step-{cfg.save_at}"
    pending: list[Any] = []

    def maybe_save(done: int, st: dict[str, Any]) -> None:
        if done == cfg.save_at:
            pending.append(ucpj.save_async(ckpt, st, step=done))

    losses_a = train(cfg, state, mesh, 0, cfg.steps, maybe_save)
    pending[0].result()
    out: dict[str, Any] = {"A (2, 4), uninterrupted": losses_a}
    for mesh_shape, transpose in (((4, 2), True), ((1, 8), False)):
        shard_b, mesh_b = layout_of(cfg, params, mesh_shape, transpose)
        resumed = ucpj.load(ckpt, abstract_state(params, shard_b, mesh_b))
        start = resumed.pop("step")
        out[f"B {mesh_shape}, resumed"] = train(cfg, resumed, mesh_b, start, cfg.steps)
    params_only = ucpj.load(ckpt, abstract_state(params, shard_b, mesh_b, with_optimizer=False))
    control = {"params": params_only["params"],
               "opt_state": optimizer_state(params, shard_b, mesh_b)}
    out["control: no optimizer state"] = train(cfg, control, mesh_b, cfg.save_at, cfg.steps)
    return out


#: The mesh of JAX's half of the experiment across frameworks.
CROSS_MESH = (2, 4)
#: The optimizer a JAX checkpoint names for PyTorch: the demo's Optax chain is torch's AdamW.
TORCH_ADAMW = "torch.optim.adamw.AdamW"


def cross(cfg: Config, torch_ckpt: str, jax_ckpt: str) -> dict[str, list[float]]:
    """JAX's half of the experiment across frameworks, on a (2, 4) mesh: resume the
    PyTorch run's checkpoint ``torch_ckpt`` (its names through
    :func:`ucpformat.jax.torch_keymap`) and train to the end (``torch_to_jax``); the same
    without the optimizer state (``torch_to_jax_control``); then train from the start,
    saving half-way into ``jax_ckpt`` as PyTorch names and lays it out (``jax``, the
    curve PyTorch's resume of it must follow)."""
    import ucpformat.jax as ucpj

    params = init_params(cfg)
    shardings, mesh = layout_of(cfg, params, CROSS_MESH, transpose=False)
    keymap = ucpj.torch_keymap(params)
    state = ucpj.load(torch_ckpt, abstract_state(params, shardings, mesh), keymap=keymap)
    start = state.pop("step")
    if start != cfg.save_at:
        raise LoadError(f"{torch_ckpt} is of step {start}, not {cfg.save_at}",
                        path=str(torch_ckpt))
    resumed = train(cfg, state, mesh, start, cfg.steps)
    only = ucpj.load(torch_ckpt, abstract_state(params, shardings, mesh, with_optimizer=False),
                     keymap=keymap)
    control = train(cfg, {"params": only["params"],
                          "opt_state": optimizer_state(params, shardings, mesh)},
                    mesh, start, cfg.steps)
    state = {"params": place(params, shardings),
             "opt_state": optimizer_state(params, shardings, mesh)}
    pending: list[Any] = []

    def maybe_save(done: int, st: dict[str, Any]) -> None:
        if done == cfg.save_at:
            pending.append(ucpj.save_async(jax_ckpt, st, step=done, keymap=keymap,
                                           optimizer_type=TORCH_ADAMW))

    reference = train(cfg, state, mesh, 0, cfg.steps, maybe_save)
    pending[0].result()
    return {"torch_to_jax": resumed, "torch_to_jax_control": control, "jax": reference}


def report(cfg: Config, curves: dict[str, list[float]], rtol: float, out: Path) -> int:
    """Table, CSV and plot; 0 if every resume follows run A within rtol and the control
    does not, else 1."""
    names = list(curves)
    reference = curves[names[0]][cfg.save_at:]
    worst = {n: max(abs(a - b) / abs(b) for a, b in zip(curves[n][-len(reference):],
                                                       reference, strict=True))
             for n in names[1:]}
    ok = all(worst[n] <= rtol for n in names[1:-1]) and worst[names[-1]] > rtol
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "losses.csv", "w") as f:
        f.write("step," + ",".join(names) + "\n")
        for i in range(cfg.steps):
            row = [curves[n][i - (cfg.steps - len(curves[n]))]
                   if i >= cfg.steps - len(curves[n]) else "" for n in names]
            f.write(f"{i + 1}," + ",".join(str(v) for v in row) + "\n")
    lines = [f"| run | last loss | max relative difference to A after step {cfg.save_at} |",
             "|---|---:|---:|"]
    lines.append(f"| {names[0]} | {curves[names[0]][-1]:.4f} | - |")
    lines += [f"| {n} | {curves[n][-1]:.4f} | {worst[n]:.2e} |" for n in names[1:]]
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for n in names:
            xs = range(cfg.steps - len(curves[n]) + 1, cfg.steps + 1)
            ax.plot(xs, curves[n], label=n, linestyle="-" if n == names[0] else "--")
        ax.axvline(cfg.save_at, color="gray", linewidth=0.8)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("JAX GPT: saved on (2, 4), resumed on other meshes")
        ax.legend()
        fig.savefig(out / "resume.png", dpi=120)
        print(f"wrote {out / 'losses.csv'}, {out / 'table.md'}, {out / 'resume.png'}")
    except ImportError:
        print(f"wrote {out / 'losses.csv'}, {out / 'table.md'} (no plot: no matplotlib)")
    print(("PASS" if ok else "FAIL") + f": resumes within rtol {rtol:g}; the control "
          f"{'outside' if worst[names[-1]] > rtol else 'INSIDE'} it")
    return 0 if ok else 1


def child_env() -> dict[str, str]:
    """The environment of a child process that runs JAX on 8 virtual CPU devices."""
    return {**os.environ, "UCP_JAX_DEMO_CHILD": "1", "JAX_PLATFORMS": "cpu",
            "TF_CPP_MIN_LOG_LEVEL": "2",  # XLA's partitioner warnings
            "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}


def run(args: argparse.Namespace) -> int:
    """The command: in a child with 8 devices unless this process has them."""
    cfg = QUICK if args.quick else Config()
    if args.steps is not None:
        cfg = Config(**{**asdict(cfg), "steps": args.steps, "save_at": args.steps // 2})
    if os.environ.get("UCP_JAX_DEMO_CHILD") != "1":
        argv = [sys.executable, "-m", "ucpformat.jax.demo", "meshes", json.dumps(asdict(cfg)),
                str(args.rtol), str(args.out)]
        return subprocess.run(argv, env=child_env()).returncode
    return _child(cfg, args.rtol, Path(args.out))


def _devices_missing() -> bool:
    jax = require("jax", extra="jax", purpose="the JAX demo")
    if len(jax.devices()) < 8:
        print(f"ucp: error: the JAX demo needs 8 devices, JAX has {len(jax.devices())}")
        return True
    return False


def _child(cfg: Config, rtol: float, out: Path) -> int:
    if _devices_missing():
        return 2
    with tempfile.TemporaryDirectory() as root:
        curves = experiment(cfg, root)
    return report(cfg, curves, rtol, out)


def _cross_child(cfg: Config, torch_ckpt: str, jax_ckpt: str, result: Path) -> int:
    if _devices_missing():
        return 2
    result.write_text(json.dumps(cross(cfg, torch_ckpt, jax_ckpt)))
    return 0


if __name__ == "__main__":
    # python -m ucpformat.jax.demo meshes CONFIG RTOL OUT
    # python -m ucpformat.jax.demo cross CONFIG TORCH_CKPT JAX_CKPT RESULT_JSON
    mode, doc = sys.argv[1:3]
    if mode == "meshes":
        sys.exit(_child(Config(**json.loads(doc)), float(sys.argv[3]), Path(sys.argv[4])))
    if mode == "cross":
        sys.exit(_cross_child(Config(**json.loads(doc)), sys.argv[3], sys.argv[4],
                              Path(sys.argv[5])))
    sys.exit(f"usage: python -m ucpformat.jax.demo meshes|cross CONFIG ...: not {mode!r}")
