"""The one save interface (issue 24): one options object, one write loop, one distributed
save driven in one order, and the old names still answering for one release."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ucpformat
from ucpformat.checkpoint import write_loop
from ucpformat.checkpoint.metadata import IN_PROGRESS_KEY
from ucpformat.checkpoint.options import SaveOptions
from ucpformat.distributed import Fragment, TensorSpec, save_fragments
from ucpformat.distributed.comm import SingleProcess
from ucpformat.distributed.pipeline import DistributedSave, FragmentList
from ucpformat.errors import InvalidValueError, WriteError


def _one_tensor() -> tuple[list[TensorSpec], FragmentList, np.ndarray[Any, Any]]:
    data = np.arange(48, dtype=np.float32).reshape(6, 8)
    spec = TensorSpec("model/w", (6, 8), "float32")
    return [spec], FragmentList([Fragment("model/w", ((0, 6), (0, 8)), data)]), data


def test_save_options_refuse_settings_given_twice() -> None:
    opts = SaveOptions(chunk_bytes=4096)
    assert SaveOptions.merged(None, chunk_bytes=4096) == opts
    assert SaveOptions.merged(opts, chunk_bytes=SaveOptions().chunk_bytes) is opts
    with pytest.raises(InvalidValueError, match="chunk_bytes"):
        SaveOptions.merged(opts, chunk_bytes=8192)


@pytest.mark.parametrize("bad", [dict(hash_algorithm="md5"), dict(chunk_bytes=0),
                                 dict(min_shard_bytes=-1), dict(workers=-1)])
def test_save_options_refuse_bad_values(bad: dict[str, Any]) -> None:
    with pytest.raises(InvalidValueError):
        SaveOptions(**bad)


def test_save_fragments_takes_options_or_keywords_not_both(tmp_path: Path) -> None:
    specs, frags, data = _one_tensor()
    save_fragments(tmp_path / "a", SingleProcess(), specs=specs, fragments=frags,
                   options=SaveOptions(durable=False, hash_algorithm="sha256"))
    assert np.array_equal(ucpformat.open(tmp_path / "a")["model/w"][...], data)
    assert ucpformat.validate(tmp_path / "a", deep=True).valid
    with pytest.raises(InvalidValueError, match="not both"):
        save_fragments(tmp_path / "b", SingleProcess(), specs=specs, fragments=frags,
                       options=SaveOptions(durable=False), overwrite=True)
    assert not (tmp_path / "b").exists()


def test_distributed_save_steps_in_order(tmp_path: Path) -> None:
    specs, frags, data = _one_tensor()
    save = DistributedSave(tmp_path / "c", SingleProcess(), SaveOptions(durable=False))
    with pytest.raises(WriteError, match="order"):
        save.write(frags)  # before the plan
    save.plan(specs, frags)
    with pytest.raises(WriteError, match="order"):
        save.plan(specs, frags)  # twice
    save.exchange(frags)
    written = save.write(frags)
    assert written and all(o.key.startswith("model/w/") for o in written)
    result = save.commit()
    assert result.tensors == 1 and result.objects_written_here == len(written)
    assert np.array_equal(ucpformat.open(tmp_path / "c")["model/w"][...], data)


def test_a_framework_that_plans_itself_claims_takes_and_commits_its_objects(
        tmp_path: Path) -> None:
    """The DCP plugin's form: claim on the coordinator, take, exchange, write,
    commit_objects with what the framework gathered."""
    from ucpformat.distributed.save_plan import make_plan

    specs, frags, data = _one_tensor()
    save = DistributedSave(tmp_path / "d", SingleProcess(), SaveOptions(durable=False))
    plan = make_plan({s.path: s for s in specs}, {"model/w": [(0, ((0, 6), (0, 8)))]}, 1,
                     compression=None, chunk_bytes=64, shard_bytes=128, min_shard_bytes=0)
    (tasks,) = save.claim(plan)
    assert [p.name for p in (tmp_path / "d").iterdir()] == [IN_PROGRESS_KEY]  # claimed
    save.take(tasks)
    save.exchange(frags)
    objects = save.write(frags)
    with pytest.raises(WriteError, match="claimed"):
        DistributedSave(tmp_path / "e", SingleProcess(), SaveOptions(durable=False)
                        ).commit_objects([], arrays=[], groups=[], root_ucp={})
    save.commit_objects(objects, arrays=[tp.meta for tp in plan.tensors.values()],
                        groups=list(plan.groups.values()), root_ucp={})
    assert np.array_equal(ucpformat.open(tmp_path / "d")["model/w"][...], data)


def test_every_writer_writes_through_the_one_loop(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = write_loop.write_objects

    def counting(store: Any, jobs: Any, **kwargs: Any) -> Any:
        calls.append(len(jobs))
        return real(store, jobs, **kwargs)

    monkeypatch.setattr(write_loop, "write_objects", counting)
    # the modules bound the loop at import: they look it up where it lives
    import ucpformat.checkpoint.writer as writer
    import ucpformat.distributed.pipeline as pipeline

    monkeypatch.setattr(writer, "write_objects", counting)
    monkeypatch.setattr(pipeline, "write_objects", counting)
    ucpformat.save(tmp_path / "s", {"model": {"w": np.ones((4, 4), np.float32)}},
                   durable=False)
    specs, frags, _ = _one_tensor()
    save_fragments(tmp_path / "f", SingleProcess(), specs=specs, fragments=frags,
                   durable=False)
    assert len(calls) == 2 and all(n >= 1 for n in calls)


@pytest.mark.parametrize(("old", "new"), [
    ("ucpformat.checkpoint.writer:commit", "ucpformat.checkpoint.commit:commit_checkpoint"),
    ("ucpformat.checkpoint.writer:Plan", "ucpformat.checkpoint.tree:TreePlan"),
    ("ucpformat.checkpoint.writer:StreamingWriter",
     "ucpformat.checkpoint.streaming:StreamingWriter"),
    ("ucpformat.checkpoint.writer:mark_destination",
     "ucpformat.checkpoint.commit:mark_destination"),
    ("ucpformat.distributed:save_distributed", "ucpformat.distributed:save_fragments"),
])
def test_old_names_answer_with_a_deprecation_warning(old: str, new: str) -> None:
    old_module, old_name = old.split(":")
    new_module, new_name = new.split(":")
    with pytest.warns(DeprecationWarning, match=new_name):
        found = getattr(importlib.import_module(old_module), old_name)
    assert found is getattr(importlib.import_module(new_module), new_name)


def test_the_new_paths_warn_nothing() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for module in ("ucpformat.checkpoint.commit", "ucpformat.distributed.pipeline",
                       "ucpformat.store", "ucpformat.format.dtypes"):
            importlib.import_module(module)


def test_commit_objects_refuses_a_missing_object_and_cleans_up(tmp_path: Path) -> None:
    from ucpformat.distributed.save_plan import make_plan

    specs, frags, _ = _one_tensor()
    save = DistributedSave(tmp_path / "g", SingleProcess(), SaveOptions(durable=False))
    plan = make_plan({s.path: s for s in specs}, {"model/w": [(0, ((0, 6), (0, 8)))]}, 1,
                     compression=None, chunk_bytes=64, shard_bytes=128, min_shard_bytes=0)
    (tasks,) = save.claim(plan)
    save.take(tasks)
    save.exchange(frags)
    objects = save.write(frags)
    assert len(objects) > 1
    with pytest.raises(WriteError, match="R132"):
        save.commit_objects(objects[:-1], arrays=[tp.meta for tp in plan.tensors.values()],
                            groups=list(plan.groups.values()), root_ucp={})
    assert not any((tmp_path / "g").iterdir())  # nothing committed, its files removed


def test_the_single_process_writers_take_the_same_options(tmp_path: Path) -> None:
    from ucpformat.checkpoint.streaming import StreamingWriter

    opts = SaveOptions(chunk_bytes=64, durable=False, hash_algorithm="sha256", workers=0)
    assert opts.workers is None  # 0 is the default, as before 0.2
    state = {"model": {"w": np.arange(64, dtype=np.float32).reshape(8, 8)}}
    ucpformat.save(tmp_path / "s", state, options=opts)
    ckpt = ucpformat.open(tmp_path / "s")
    assert ckpt["model/w"].meta.chunk_shape != (8, 8)  # the options' chunk size was used
    with pytest.raises(InvalidValueError, match="not both"):
        ucpformat.save(tmp_path / "t", state, options=opts, chunk_bytes=128)
    # StreamingWriter hashes by default: its own default is not "given" beside options
    with StreamingWriter(tmp_path / "w", options=SaveOptions(durable=False)) as w:
        assert w.hash_algorithm is None
        w.declare("model/w", (8, 8), "float32")
        w.write("model/w", state["model"]["w"])
        w.commit()


def test_old_module_attributes_and_entry_points(tmp_path: Path) -> None:
    import subprocess
    import sys
    import tomllib

    from ucpformat.compat import MOVED

    vars(ucpformat).pop("storage", None)  # set by an earlier import of the old path
    with pytest.warns(DeprecationWarning, match="ucpformat.store"):
        assert ucpformat.storage.LocalStore is importlib.import_module(  # type: ignore[attr-defined]
            "ucpformat.store").LocalStore
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    for group in project["project"]["entry-points"].values():
        for target in group.values():
            assert target.split(":")[0] not in MOVED, target
    done = subprocess.run([sys.executable, "-m", "ucpformat.testing.links", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "link_attacks" in done.stdout + done.stderr, done.stderr
