"""The UCP plugin under DCP's process mode (issue 28): ``dcp.async_save(state,
storage_writer=UCPWriter(path), async_checkpointer_type=AsyncCheckpointerType.PROCESS)``.

The writer is pickled to DCP's background process, which plans, writes and commits the
checkpoint there; a failure there (a committed checkpoint without ``overwrite``) is
raised by the future, and the checkpoint is left as it was. The scenario runs in its own
process (:mod:`tests.torch.dcp_process_worker`): the process mode needs a process group.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.torch, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_plugin_saves_commits_and_fails_in_dcp_background_process(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.torch.dcp_process_worker", str(tmp_path),
             str(_free_port())],
            env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=240, check=False)
    result = json.loads((tmp_path / "result.json").read_text())
    assert proc.returncode == 0 and "error" not in result, \
        result.get("error") or log.read_text()[-4000:]
    # the commit ran in DCP's background process, not in the caller's
    assert result["writer_pid"] != result["parent_pid"]
    assert result["first_equal"]
    assert "manifest.ucp.json" in result["files"] and "zarr.json" in result["files"]
    assert not any(f.endswith((".distcp", ".metadata", ".pkl")) for f in result["files"])
    # the failure in the background process reached the caller's future, by name
    assert result["failure"] and "CheckpointExistsError" in result["failure"]
    assert result["kept_after_failure"]  # the committed checkpoint is as it was
    assert result["replaced"]  # overwrite=True in the background process
