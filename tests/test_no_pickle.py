"""No pickle anywhere in the format or its reading path: reading a checkpoint never runs code."""

from __future__ import annotations

import io
import pickle
import tokenize
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

import ucpformat

PACKAGE = Path(ucpformat.__file__).resolve().parent
#: Integrations that read other frameworks' files (which are pickles) live apart from the
#: format core and are not scanned: torch, importers of foreign checkpoints, and the
#: megatron-core strategies (which unpickle only opaque objects, on explicit opt-in).
EXCLUDED = ("torch", "importers", "exporters", "megatron")
#: Names whose use would load pickles or run code from data.
FORBIDDEN_NAMES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal",
                   "shelve", "eval", "exec", "__import__"}
FORBIDDEN_CALLS = {("torch", "load"), ("np", "load"), ("numpy", "load")}
#: Modules of the excluded integrations that never unpickle either: the writer process
#: reads its parent's messages as JSON (``multiprocessing.connection.Connection``'s
#: ``send``/``recv``, which pickle, are forbidden there too; ``send_bytes`` is bytes).
PICKLE_FREE = ("torch/writer_process.py", "torch/writer_wire.py")
CONNECTION_PICKLING = {"send", "recv"}


def core_sources() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] not in EXCLUDED or rel.as_posix() in PICKLE_FREE:
            yield path


def connection_pickling(source: str) -> list[str]:
    """Calls of a ``Connection``'s pickling ``.send(`` / ``.recv(`` among the code tokens."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP)]
    return [f"line {tok.start[0]}: .{tok.string}(" for i, tok in enumerate(tokens[1:-1], 1)
            if tok.string in CONNECTION_PICKLING and tokens[i - 1].string == "."
            and tokens[i + 1].string == "("]


def forbidden_uses(source: str) -> list[str]:
    """Forbidden names and calls among the code tokens (comments and strings are text)."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline)
              if t.type in (tokenize.NAME, tokenize.OP)]
    found = []
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NAME:
            continue
        if tok.string in FORBIDDEN_NAMES:
            found.append(f"line {tok.start[0]}: {tok.string}")
        if (i + 2 < len(tokens) and tokens[i + 1].string == "."
                and (tok.string, tokens[i + 2].string) in FORBIDDEN_CALLS):
            found.append(f"line {tok.start[0]}: {tok.string}.{tokens[i + 2].string}")
    return found


def test_the_scanner_finds_what_it_looks_for() -> None:
    bad = "import pickle\nx = torch.load(f)\ny = eval('1')\nexec(code)\nnp.load(p)\n"
    assert len(forbidden_uses(bad)) == 5
    assert forbidden_uses("'''no pickle here''' # nor eval( here\nretrieval(x)\n") == []


def test_core_sources_use_no_pickle_eval_or_exec() -> None:
    sources = list(core_sources())
    assert {p.name for p in sources} >= {"reader.py", "writer.py", "codecs.py", "validation.py",
                                         "writer_process.py", "writer_wire.py"}
    problems = {str(p.relative_to(PACKAGE)): forbidden_uses(p.read_text()) for p in sources}
    assert {k: v for k, v in problems.items() if v} == {}


def test_the_writer_process_sends_no_pickles_over_its_connection() -> None:
    assert connection_pickling("conn.send((1,))\nx = c.recv()\nc.send_bytes(b)\nsend(m)\n") \
        == ["line 1: .send(", "line 2: .recv("]
    for rel in PICKLE_FREE:
        assert connection_pickling((PACKAGE / rel).read_text()) == [], rel


def test_core_text_mentions_no_torch_load() -> None:
    for path in core_sources():
        text = path.read_text()
        assert "torch.load" not in text and "pickle.load" not in text, path


def _refuse(*_args: Any, **_kw: Any) -> NoReturn:
    raise AssertionError("pickle was used while reading a checkpoint")


class _NoUnpickler:
    def __init__(self, *_args: Any, **_kw: Any) -> None:
        _refuse()


def test_reading_never_unpickles(
    monkeypatch: pytest.MonkeyPatch, saved: Callable[..., Path], small_state: dict[str, Any]
) -> None:
    path = saved(compression="blosc", chunk_bytes=256, shard_bytes=4096)
    for name in ("loads", "load"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(pickle, "Unpickler", _NoUnpickler)
    import _pickle

    for name in ("loads", "load"):
        monkeypatch.setattr(_pickle, name, _refuse)
    monkeypatch.setattr(_pickle, "Unpickler", _NoUnpickler)
    monkeypatch.setattr(np, "load", _refuse)

    with ucpformat.open(path) as ckpt:
        state = ckpt.to_dict()
        assert ckpt["model/fc.weight"][::7, 3].shape == (14,)
    assert np.array_equal(state["model"]["fc.weight"], small_state["model"]["fc.weight"])
    assert ucpformat.validate(path, deep=True).valid
