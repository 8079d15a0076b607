"""``model_state_dict``: DCP's ``get_model_state_dict`` without its per-key walk where no
wrapper renames keys, and DCP's own answer where one does (keys, and the very tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    checkpoint_wrapper,
)
from torch.distributed.checkpoint import state_dict as dsd  # noqa: E402

import ucpformat  # noqa: E402
from ucpformat.torch.async_save import AsyncSaver  # noqa: E402
from ucpformat.torch.distributed import model_state_dict, renames_keys  # noqa: E402


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.register_buffer("running", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # tied


class _Doubled(torch.nn.Module):
    """Extra state computed from a parameter: a graph, unless taken without autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def get_extra_state(self) -> Any:
        return self.lin.weight * 2

    def set_extra_state(self, state: Any) -> None:
        pass


class _Modified(torch.nn.Module):
    """A module that tells DCP to drop a name from its FQNs (``_fqn_modifiers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.wrapped = torch.nn.Linear(2, 2)

    def _fqn_modifiers(self) -> dict[str, str]:
        return {}


def _dcp(model: torch.nn.Module) -> dict[str, Any]:
    options = dsd.StateDictOptions(full_state_dict=False, cpu_offload=False)
    return dict(dsd.get_model_state_dict(model, options=options))


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for key in a:
        assert a[key] is b[key] or (a[key].data_ptr() == b[key].data_ptr()
                                    and a[key].shape == b[key].shape), key


def test_a_model_without_wrappers_gets_its_own_state_dict_without_dcp(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = _Model()
    expected = _dcp(model)
    assert not renames_keys(model)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fast path called DCP")

    monkeypatch.setattr("ucpformat.torch.distributed.get_model_state_dict", refuse)
    got = model_state_dict(model)
    _same(got, expected)
    assert "blocks.0.scratch" not in got and "head.weight" in got  # as DCP: tied kept


def test_extra_state_is_taken_without_autograd_as_dcp_takes_it() -> None:
    model = torch.nn.Sequential(_Doubled())
    assert not renames_keys(model)
    got, expected = model_state_dict(model), _dcp(model)
    assert list(got) == list(expected) == ["0._extra_state", "0.lin.weight", "0.lin.bias"]
    assert not got["0._extra_state"].requires_grad
    assert not expected["0._extra_state"].requires_grad
    assert torch.equal(got["0._extra_state"], expected["0._extra_state"])


@pytest.mark.parametrize("wrap", ["checkpoint_wrapper", "torch.compile", "fqn_modifiers"])
def test_a_model_with_a_renaming_wrapper_gets_dcps_answer(wrap: str) -> None:
    model: torch.nn.Module = _Model()
    if wrap == "checkpoint_wrapper":
        model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    elif wrap == "torch.compile":
        model = torch.compile(model)  # compiles lazily: nothing is compiled here
    else:
        model.extra = _Modified()
    assert renames_keys(model)
    got = model_state_dict(model)
    _same(got, _dcp(model))
    assert not any("_orig_mod" in k or "_checkpoint_wrapped" in k for k in got)


def test_an_empty_model_is_refused_as_dcp_refuses_it() -> None:
    with pytest.raises(Exception) as dcp_refused:
        _dcp(torch.nn.Module())
    with pytest.raises(type(dcp_refused.value)):
        model_state_dict(torch.nn.Module())


def test_a_checkpoint_wrapped_model_saves_its_parameters_by_fqn(tmp_path: Path) -> None:
    """The parameter / buffer roles come from the FQNs of the parameters: a wrapper's
    names still go through DCP's renaming, a plain model's are the FQNs as they are."""
    model = _Model()
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    with AsyncSaver() as saver:
        saver.save(tmp_path / "ckpt", model=model).result()
    with ucpformat.open_checkpoint(tmp_path / "ckpt") as ck:
        roles = {p: ck.arrays[p].attributes["ucp"]["role"] for p in ck.arrays}
    assert roles == {"model/embed.weight": "parameter", "model/blocks.0.running": "buffer",
                     "model/blocks.1.running": "buffer",
                     **{f"model/blocks.{i}.inner.{p}": "parameter"
                        for i in (0, 1) for p in ("weight", "bias")}}


def _trained(seed: int, kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Model()
    model.blocks[0].inner.bias.requires_grad_(False)  # frozen: in no param group
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": trainable[:2], "lr": 0.1}, {"params": trainable[2:], "lr": 0.01}]
    optimizer = (torch.optim.AdamW(groups) if kind.startswith("adamw")
                 else torch.optim.SGD(groups, momentum=0.9))
    if not kind.endswith("fresh"):  # fresh: no state yet, both initialise it
        model.embed(torch.tensor([1, 2])).sum().backward()
        for p in trainable:
            if p.grad is None:
                p.grad = torch.ones_like(p)
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("kind", ["adamw", "adamw-fresh", "sgd", "sgd-fresh"])
def test_optimizer_state_dict_is_dcps_without_dcp(kind: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two identical models and optimizers: DCP's answer for one, ours for the other
    (DCP's initialisation of an empty state changes the optimizer, so not the same one):
    the same FQN keys, state values, param_groups, and the same change to the model."""
    from ucpformat.torch.distributed import optimizer_state_dict

    model_a, opt_a = _trained(0, kind)
    options = dsd.StateDictOptions(full_state_dict=False, cpu_offload=False)
    expected = dsd.get_optimizer_state_dict(model_a, opt_a, options=options)
    model_b, opt_b = _trained(0, kind)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the fast path called DCP")

    monkeypatch.setattr("ucpformat.torch.distributed.get_optimizer_state_dict", refuse)
    got = optimizer_state_dict(model_b, opt_b)
    assert expected["state"] and "blocks.0.inner.bias" not in expected["state"]  # frozen
    assert list(got) == ["state", "param_groups"]
    assert got["param_groups"] == expected["param_groups"]
    assert list(got["state"]) == list(expected["state"])
    for fqn, entries in expected["state"].items():
        assert list(got["state"][fqn]) == list(entries), fqn
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(got["state"][fqn][name]),
                               torch.as_tensor(value)), (fqn, name)
    for (name, a), b in zip(model_a.state_dict().items(), model_b.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name  # the zero-lr initialisation changed neither
