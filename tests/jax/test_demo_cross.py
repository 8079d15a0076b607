"""The demo's GPT across frameworks at its quick size: trained half-way in PyTorch
(ucpformat.torch.demo, one process), resumed in JAX on a (2, 4) mesh
(ucpformat.jax.demo, torch_keymap), the losses following the PyTorch run's; and the
reverse. Tolerance and control as in test_cross_framework.py (measured values in
docs/jax.md)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

import ucpformat.jax as ucpj
from ucpformat.jax import demo as jd

torch = pytest.importorskip("torch")
td = pytest.importorskip("ucpformat.torch.demo")
ucpt = pytest.importorskip("ucpformat.torch")

TOLERANCE = 1e-4  # relative difference of each resumed loss (float32 kernels differ)
CONTROL = 1e-4  # the resume without optimizer state differs by more than this
CFG = jd.QUICK
TCFG = td.QUICK
ONE = td.LAYOUT_C


def relative(a: list[float], b: list[float]) -> float:
    return max(abs(p - q) / abs(q) for p, q in zip(a, b, strict=True))


def jax_state(mesh_shape: tuple[int, int], *, optimizer_state: bool = True) -> Any:
    """The target of a load (ShapeDtypeStructs on a mesh) and that mesh."""
    params = jd.init_params(CFG)
    shardings, mesh = jd.layout_of(CFG, params, mesh_shape, transpose=False)
    abstract = jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), np.float32, sharding=s), params, shardings)
    if not optimizer_state:
        return {"params": abstract}, mesh, params, shardings
    zero = jd.optimizer().init(params)
    count = jax.ShapeDtypeStruct((), np.int32, sharding=jd.replicated(mesh))
    return ({"params": abstract, "opt_state": (zero[0]._replace(count=count, mu=abstract,
                                                                  nu=abstract), *zero[1:]),
             "step": 0}, mesh, params, shardings)


def torch_model() -> tuple[Any, Any, Any]:
    model, _ = td.build(TCFG, ONE)
    opt, sched = td.make_optimizer(TCFG, model)
    return model, opt, sched


@pytest.mark.slow
def test_torch_to_jax(tmp_path: Path) -> None:
    model, opt, sched = torch_model()
    td.train_steps(TCFG, ONE, model, opt, sched, 0, 0, TCFG.save_at)
    ucpt.save(tmp_path / "t", model=model, optimizer=opt, scheduler=sched, step=TCFG.save_at)
    reference = td.train_steps(TCFG, ONE, model, opt, sched, 0, TCFG.save_at, TCFG.steps)

    target, mesh, params, shardings = jax_state((2, 4))
    keymap = ucpj.torch_keymap(params)
    state = ucpj.load(tmp_path / "t", target, keymap=keymap)
    start = state.pop("step")
    resumed = jd.train(CFG, state, mesh, start, CFG.steps)
    assert relative(resumed, reference) < TOLERANCE, (resumed, reference)

    only, mesh, params, shardings = jax_state((2, 4), optimizer_state=False)
    got = ucpj.load(tmp_path / "t", only, keymap=keymap)
    fresh = jd.optimizer().init(params)
    control = {"params": got["params"], "opt_state": (fresh[0]._replace(
        count=jd.place(fresh[0].count, jd.replicated(mesh)), mu=jd.place(fresh[0].mu, shardings),
        nu=jd.place(fresh[0].nu, shardings)), *fresh[1:])}
    assert relative(jd.train(CFG, control, mesh, start, CFG.steps), reference) > CONTROL


@pytest.mark.slow
def test_jax_to_torch(tmp_path: Path) -> None:
    params = jd.init_params(CFG)
    shardings, mesh = jd.layout_of(CFG, params, (2, 4), transpose=False)
    zero = jd.optimizer().init(params)
    state = {"params": jd.place(params, shardings), "opt_state": (zero[0]._replace(
        count=jd.place(zero[0].count, jd.replicated(mesh)), mu=jd.place(zero[0].mu, shardings),
        nu=jd.place(zero[0].nu, shardings)), *zero[1:])}
    jd.train(CFG, state, mesh, 0, CFG.save_at)
    ucpj.save(tmp_path / "j", state, step=CFG.save_at, keymap=ucpj.torch_keymap(params),
              optimizer_type="torch.optim.adamw.AdamW")
    reference = jd.train(CFG, state, mesh, CFG.save_at, CFG.steps)

    def resumed(with_optimizer: bool) -> list[float]:
        model, opt, sched = torch_model()
        ucpt.load(tmp_path / "j", model=model, optimizer=opt if with_optimizer else None,
                  strict=with_optimizer)
        for group in opt.param_groups:  # JAX keeps no torch hyperparameters: the demo's
            group["lr"], group["weight_decay"] = TCFG.lr, 0.1
            group["initial_lr"] = TCFG.lr
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the scheduler stepped without the optimizer
            for _ in range(CFG.save_at):
                sched.step()
        return td.train_steps(TCFG, ONE, model, opt, sched, 0, CFG.save_at, CFG.steps)

    assert relative(resumed(True), reference) < TOLERANCE
    assert relative(resumed(False), reference) > CONTROL
