"""What a new user tripped on (issue 15, item 7), core and command line: each test failed
before its fix."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from tests.helpers import ucp
from ucpformat.checkpoint.metadata import MANIFEST_KEY
from ucpformat.checkpoint.tree import Group
from ucpformat.cli import build_parser
from ucpformat.errors import CheckpointNotFoundError, MissingDependencyError
from ucpformat.layout.rules import builtin_rule_files
from ucpformat.store import LocalStore

REPO = Path(__file__).resolve().parents[1]


# -- a file where a checkpoint directory is expected ------------------------------------


def test_open_and_validate_refuse_a_file_by_name(tmp_path: Path) -> None:
    model_file = tmp_path / "model.safetensors"
    model_file.write_bytes(b"not a directory")
    with pytest.raises(CheckpointNotFoundError, match="a checkpoint is a directory"):
        ucpformat.open(model_file)
    report = ucpformat.validate(model_file)
    assert not report.valid
    assert report.errors[0].rule == "UCP-1.0-R051"
    assert "a checkpoint is a directory" in report.errors[0].message


# -- ucp validate --deep reads every byte once ----------------------------------------------


class CountingStore(LocalStore):
    """A LocalStore that counts the bytes it returns, per key."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, durable=False)
        self.read: Counter[str] = Counter()

    def get(self, key: str) -> bytes | None:
        data = super().get(key)
        self.read[key] += len(data or b"")
        return data

    def get_range(self, key: str, offset: int, length: int) -> bytes | None:
        data = super().get_range(key, offset, length)
        self.read[key] += len(data or b"")
        return data

    def get_suffix(self, key: str, length: int) -> bytes | None:
        data = super().get_suffix(key, length)
        self.read[key] += len(data or b"")
        return data

    def read_into(self, key: str, offset: int, buffers: Any) -> int | None:
        n = super().read_into(key, offset, buffers)
        self.read[key] += n or 0
        return n


def test_deep_validation_reads_each_stored_object_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    state = {"model": {"w": rng.standard_normal((64, 48)).astype(np.float32),
                       "b": np.arange(7, dtype=np.int64)}}
    ucpformat.save(tmp_path / "c", state, chunk_bytes=2048, shard_bytes=8192, durable=False)
    manifest = json.loads((tmp_path / "c" / MANIFEST_KEY).read_text())["files"]
    sizes = {k: e["nbytes"] for k, e in manifest.items()}
    store = CountingStore(tmp_path / "c")
    advanced: list[int] = []
    report = ucpformat.validate(store, deep=True, progress=advanced.append)
    assert report.valid, report.errors
    assert report.checked_objects == sum(1 for k in sizes if not k.endswith("zarr.json"))
    for key, size in sizes.items():  # every listed file read whole, and only once
        assert store.read[key] == size, key
    assert sum(advanced) == sum(sizes.values())  # the bar's total is the checkpoint's size


def test_deep_validation_still_finds_a_bad_digest_and_a_bad_chunk(tmp_path: Path) -> None:
    state = {"model": {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}}
    ucpformat.save(tmp_path / "c", state, chunk_bytes=4096, durable=False, hash_algorithm="sha256")
    shard = next(p for p in (tmp_path / "c" / "model" / "w").rglob("*")
                 if p.is_file() and p.name != "zarr.json")
    data = bytearray(shard.read_bytes())
    data[10] ^= 0xFF
    shard.write_bytes(bytes(data))
    rules = {i.rule for i in ucpformat.validate(tmp_path / "c", deep=True).errors}
    assert {"UCP-1.0-R043", "UCP-1.0-R041"} <= rules


# -- ucp inspect shows tied aliases --------------------------------------------------------


@pytest.fixture
def tied(tmp_path: Path) -> Path:
    model = Group(ucp={"aliases": {"lm_head.weight": "embed.weight"}})
    model["embed.weight"] = np.ones((10, 4), np.float32)
    ucpformat.save(tmp_path / "tied", {"model": model}, durable=False)
    return tmp_path / "tied"


def test_inspect_shows_tied_aliases(capsys: pytest.CaptureFixture[str], tied: Path) -> None:
    code, out, _ = ucp(capsys, "inspect", str(tied))
    assert code == 0
    line = next(x for x in out.splitlines() if "lm_head.weight" in x)
    assert "-> embed.weight" in line and "tied" in line
    code, out, _ = ucp(capsys, "inspect", "--json", str(tied))
    assert json.loads(out)["aliases"] == [{"group": "model", "name": "lm_head.weight",
                                           "target": "embed.weight",
                                           "target_path": "model/embed.weight"}]


# -- missing optional dependencies name their extra ------------------------------------------


def test_s3_without_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now fails
    monkeypatch.setitem(sys.modules, "fsspec.core", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'ucpformat\[s3\]'"):
        ucpformat.open("s3://bucket/ckpt")
    code, _, err = ucp(capsys, "inspect", "s3://bucket/ckpt")
    assert code == 2
    assert "internal error" not in err and "ucpformat[s3]" in err


def test_s3_without_s3fs_names_the_extra() -> None:
    pytest.importorskip("fsspec")
    # a fresh interpreter: fsspec caches the S3 file system class once it has imported it
    proc = subprocess.run([sys.executable, "-c", (
        "import sys; sys.modules['s3fs'] = None\n"
        "import ucpformat\n"
        "try:\n    ucpformat.open('s3://bucket/ckpt')\n"
        "except ucpformat.errors.MissingDependencyError as exc:\n    print(exc)\n")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'ucpformat[s3]'" in proc.stdout


# -- command-line wording -----------------------------------------------------------------------


def test_cli_errors_name_flags_not_keywords(capsys: pytest.CaptureFixture[str],
                                            saved: Callable[..., Path], tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    from safetensors.numpy import save_file

    save_file({"w": np.ones(3, np.float32)}, str(tmp_path / "m.safetensors"))
    dst = saved(name="dst")
    code, _, err = ucp(capsys, "convert", str(tmp_path / "m.safetensors"), str(dst))
    assert code == 2
    assert "pass --overwrite to replace it" in err and "overwrite=True" not in err


def test_flag_spelling_only_where_the_command_has_the_flag() -> None:
    from ucpformat.cli.common import as_flags

    flags = {"--overwrite", "--param-names", "--allow-pickle"}
    assert as_flags("pass overwrite=True", flags) == "pass --overwrite"
    assert as_flags("or param_names='model-order'", flags) == "or --param-names model-order"
    assert as_flags("(param_names=[...])", flags) == "(--param-names NAME,NAME,...)"
    assert as_flags("pass strict=False to load", flags) == "pass strict=False to load"
    assert as_flags("allow_pickle=True (--allow-pickle)", flags) == \
        "allow_pickle=True (--allow-pickle)"


def test_rules_help_lists_every_shipped_rule_file(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    assert "megatron-deepspeed-gpt" in builtin_rule_files()
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens otherwise
    _, out, _ = ucp(capsys, "convert", "--help")
    for name in builtin_rule_files():
        assert name in out


def _parsers(parser: Any) -> Iterator[Any]:
    yield parser
    for action in parser._actions:  # argparse has no public list of subparsers
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_help_texts_have_no_rest_markup() -> None:
    seen = 0
    for parser in _parsers(build_parser()):
        text = parser.format_help()
        seen += 1
        for markup in ("``", ":mod:", ":func:", ":class:", ":meth:"):
            assert markup not in text, (parser.prog, markup)
    assert seen > 10  # every command and the conformance subcommands


def test_no_escape_sequences_off_a_terminal(saved: Callable[..., Path], tmp_path: Path) -> None:
    good = saved(name="good")
    bad = saved(name="bad")
    (bad / MANIFEST_KEY).unlink()  # invalid: error lines, styled on a terminal
    env = {**os.environ, "PYTHONPATH": str(REPO), "FORCE_COLOR": "1", "TERM": "xterm"}
    for argv in (["validate", str(bad)], ["validate", "--deep", str(good)],
                 ["inspect", str(good)], ["diff", str(good), str(bad)]):
        proc = subprocess.run([sys.executable, "-m", "ucpformat.cli", *argv],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.stdout or proc.stderr
        assert "\x1b" not in proc.stdout + proc.stderr, argv


# -- ucp diff compares metadata ---------------------------------------------------------------


def test_diff_reports_root_metadata(capsys: pytest.CaptureFixture[str],
                                    saved: Callable[..., Path]) -> None:
    a = saved(name="a", metadata={"run": "x", "lr": 1e-3})
    b = saved(name="b", metadata={"run": "y", "lr": 1e-3})
    code, out, _ = ucp(capsys, "diff", str(a), str(b))
    assert code == 1
    assert "metadata   metadata.run  x -> y" in out
    assert out.strip().splitlines()[-1].startswith("different:")
    code, out, _ = ucp(capsys, "diff", "--data-only", str(a), str(b))
    assert code == 0
    assert "metadata.run" not in out  # --data-only prints data differences only
    assert out.strip().splitlines()[-1] == (
        "identical: 7 equal; 1 metadata difference(s) not shown (--data-only)")
    code, out, _ = ucp(capsys, "diff", "--json", str(a), str(b))
    doc = json.loads(out)
    assert doc["identical"] is False
    assert doc["metadata"] == [{"group": "", "key": "metadata.run", "status": "different",
                                "a": "x", "b": "y"}]


def test_diff_reports_array_and_group_metadata(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    w = np.ones((4, 4), np.float32)

    def save(name: str, role: str, aliases: dict[str, str]) -> Path:
        model = Group(ucp={"aliases": aliases} if aliases else None)
        model["w"] = w
        ucpformat.save(tmp_path / name, {"model": model}, durable=False,
                       array_attributes=lambda p, a: {"ucp": {"role": role}})
        return tmp_path / name

    a = save("a", "parameter", {})
    b = save("b", "buffer", {"v": "w"})
    code, out, _ = ucp(capsys, "diff", "--json", str(a), str(b))
    assert code == 1
    keys = {(m["group"], m["key"]) for m in json.loads(out)["metadata"]}
    assert keys == {("model/w", "role"), ("model", "aliases")}
