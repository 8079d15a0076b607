"""``engine.save_checkpoint`` writing UCP: a DeepSpeed checkpoint engine.

DeepSpeed hands a checkpoint engine the per-rank state dicts it builds
(``save(state_dict, path)``: model states, optimizer partitions, pipeline layers) and
then calls ``commit(info)`` on every rank. :class:`UCPCheckpointEngine` writes none of
those files: it keeps the client state DeepSpeed merged into the model states, and in
``commit`` runs :func:`ucpformat.deepspeed.save` on the engine itself, which writes the
consolidated checkpoint ``save_dir/tag`` (and ``save_dir/latest``)::

    engine.checkpoint_engine = UCPCheckpointEngine(engine)
    engine.save_checkpoint("ckpt", client_state={"epoch": 3})   # ckpt/global_step<N>: UCP

DeepSpeed also copies its recovery scripts, ``zero_to_fp32.py`` and ``zero_to_torch.py``,
into ``save_dir``; they read per-rank ZeRO files that a UCP checkpoint does not have and
fail there. After the save, rank 0 replaces each script that is DeepSpeed's own copy by
:data:`RECOVERY_STUB`, which says that the checkpoint is consolidated already and names
``ucp export`` (unless ``save_dir`` also holds DeepSpeed's own checkpoints, for which the
scripts still work).

Loading cannot go through a checkpoint engine: ``engine.load_checkpoint`` finds the
files to read by their per-rank names, on disk (``glob``, ``os.path.exists``), reads
the universal layout's pickles itself, and expects state dicts laid out for
the saving world size; it fails in DeepSpeed's own code (a bare ``AssertionError`` of
``check_ckpt_list``) before a checkpoint engine's ``load`` is called, so the plug-in
replaces the engine's ``load_checkpoint`` while it is the engine's checkpoint engine: it
raises :class:`~ucpformat.errors.UnsupportedFeatureError` naming
:func:`ucpformat.deepspeed.load` at once.
DeepSpeed is not imported here: the class has the methods DeepSpeed calls.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Mapping
from typing import Any

from ucpformat.errors import UnsupportedFeatureError

#: DeepSpeed's recovery scripts that ``save_checkpoint`` copies into the save directory.
RECOVERY_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")

#: What replaces them in a directory of UCP checkpoints (``{script}``: its name).
RECOVERY_STUB = '''#!/usr/bin/env python3
"""Written by ucpformat's UCPCheckpointEngine in place of DeepSpeed's {script}."""
import sys

sys.exit(
    "{script}: the checkpoints in this directory are UCP checkpoints (ucpformat's "
    "UCPCheckpointEngine), already consolidated: there are no per-rank ZeRO files to "
    "merge. Read one with ucpformat.open(DIR/TAG), or write the consolidated weights with "
    "'ucp export --to safetensors DIR/TAG OUT' (or --to torch); "
    "'ucp inspect DIR' shows the newest."
)
'''


def replace_recovery_scripts(save_dir: str) -> list[str]:
    """Replace DeepSpeed's recovery scripts in ``save_dir`` by :data:`RECOVERY_STUB`; the
    paths replaced. A script that is not DeepSpeed's own copy (a user's file) stays, and
    so do all where ``save_dir`` holds a DeepSpeed checkpoint (``*_model_states.pt``)."""
    deepspeed = sys.modules.get("deepspeed")
    origin = getattr(deepspeed, "__file__", None)
    if origin is None or glob.glob(os.path.join(glob.escape(save_dir), "*",
                                                "*_model_states.pt")):
        return []
    replaced = []
    for script in RECOVERY_SCRIPTS:
        path = os.path.join(save_dir, script)
        try:
            with open(os.path.join(os.path.dirname(origin), "utils", script), "rb") as f:
                theirs = f.read()
            with open(path, "rb") as f:
                if f.read() != theirs:
                    continue
        except OSError:
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(RECOVERY_STUB.format(script=script))
        replaced.append(path)
    return replaced


class UCPCheckpointEngine:
    """A DeepSpeed checkpoint engine whose checkpoints are consolidated UCP checkpoints.

    ``save_options`` go to :func:`ucpformat.deepspeed.save` (``rules``, ``rule_params``,
    ``compression``, ``workers``, ...); ``overwrite`` defaults to True here, as
    ``save_checkpoint`` replaces a tag it saves again.
    """

    name = "UCPCheckpointEngine"

    def __init__(self, engine: Any, **save_options: Any) -> None:
        self.engine = engine
        self.save_options = {"overwrite": True, **save_options}
        self.client_state: dict[str, Any] = {}
        self.last_result: Any = None
        self._guard_load_checkpoint(engine)

    def _guard_load_checkpoint(self, engine: Any) -> None:
        """``engine.load_checkpoint`` fails in DeepSpeed's own code before it reaches
        :meth:`load` (``SDLoaderBase.check_ckpt_list``: a bare ``AssertionError``, as a UCP
        checkpoint has no ``mp_rank_*_model_states.pt``): while this plug-in is the
        engine's checkpoint engine, the engine's ``load_checkpoint`` refuses at once with
        the error of :meth:`load`, which names :func:`ucpformat.deepspeed.load`."""
        original = getattr(engine, "load_checkpoint", None)
        if original is None or getattr(original, "_ucp_guarded", False):
            return

        def load_checkpoint(load_dir: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(engine, "checkpoint_engine", None) is self:
                return self.load(os.fspath(load_dir))
            return original(load_dir, *args, **kwargs)

        load_checkpoint._ucp_guarded = True  # type: ignore[attr-defined]
        engine.load_checkpoint = load_checkpoint

    # -- what DeepSpeed calls while saving -------------------------------------------------

    def create(self, info: Any) -> None:
        self.client_state = {}

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        """Keep the client state of a model-states dict; write nothing."""
        from ucpformat.importers.deepspeed import DS_KEYS

        if isinstance(state_dict, Mapping) and "module" in state_dict and (
                "global_steps" in state_dict):
            self.client_state = {k: v for k, v in state_dict.items() if k not in DS_KEYS}

    def commit(self, info: Any) -> bool:
        """Collective: the consolidated save of the engine into ``save_dir/tag``."""
        from ucpformat.deepspeed.save import save

        self.last_result = save(self.engine, info.save_dir, tag=str(info.tag),
                                client_state=self.client_state, **self.save_options)
        if getattr(self.engine, "global_rank", 0) == 0:  # the rank DeepSpeed copied them on
            replace_recovery_scripts(str(info.save_dir))
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone tensors for files that are never written

    def set_commit_info(self, info: Any) -> None:
        return None

    def get_commit_info(self) -> None:
        return None

    def cleanup(self) -> None:
        return None

    # -- loading ---------------------------------------------------------------------------

    def load(self, path: str, map_location: Any = None) -> Any:
        raise UnsupportedFeatureError(
            "DeepSpeed's load_checkpoint reads per-rank files that a UCP checkpoint does not "
            "have; resume with ucpformat.deepspeed.load(engine, path) (the same for every "
            "ZeRO stage and world size), nothing was loaded", path=path)


__all__ = ["RECOVERY_SCRIPTS", "RECOVERY_STUB", "UCPCheckpointEngine", "replace_recovery_scripts"]
