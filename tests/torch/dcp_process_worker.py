"""The UCP plugin under DCP's process mode (run by tests/torch/test_dcp_process.py).

``python -m tests.torch.dcp_process_worker <directory> <port>``: one rank (a gloo group
of one: DCP's process mode needs a process group) saves with
``dcp.async_save(..., storage_writer=UCPWriter(path),
async_checkpointer_type=AsyncCheckpointerType.PROCESS)``: the writer is sent to DCP's
background process, which plans, writes and commits. Then a second save to the same
location without ``overwrite`` fails there, and a third with ``overwrite=True`` replaces
it. Writes ``<directory>/result.json`` for the test; ends with ``os._exit`` (torch 2.13
with gloo sometimes aborts at interpreter shutdown otherwise).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

from ucpformat.torch.dcp import UCPWriter


class PidWriter(UCPWriter):
    """A UCPWriter that notes the process its ``finish`` (the commit) runs in."""

    def finish(self, metadata: Any, results: Any) -> None:
        super().finish(metadata, results)
        Path(str(self.path) + ".pid").write_text(str(os.getpid()))


def scenario(directory: Path) -> dict[str, Any]:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    import ucpformat
    import ucpformat.torch as ucpt
    process = AsyncCheckpointerType.PROCESS
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    path = directory / "ckpt"
    out: dict[str, Any] = {"parent_pid": os.getpid()}

    future = dcp.async_save({"model": model.state_dict()}, storage_writer=PidWriter(path),
                            async_checkpointer_type=process)
    future.result()
    ucpformat.open(path).close()  # committed: open refuses anything else
    out["writer_pid"] = int(Path(str(path) + ".pid").read_text())
    back = ucpt.load_state_dict(path)
    out["first_equal"] = all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    out["files"] = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())

    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    future = dcp.async_save({"model": model.state_dict()}, storage_writer=UCPWriter(path),
                            async_checkpointer_type=process)
    try:
        future.result()
        out["failure"] = None
    except BaseException as exc:  # what DCP's future raises: a CheckpointException
        out["failure"] = f"{type(exc).__name__}: {exc}"
    back = ucpt.load_state_dict(path)
    out["kept_after_failure"] = all(torch.equal(back[k], v) for k, v in first.items())

    future = dcp.async_save({"model": model.state_dict()},
                            storage_writer=UCPWriter(path, overwrite=True),
                            async_checkpointer_type=process)
    future.result()
    back = ucpt.load_state_dict(path)
    out["replaced"] = all(torch.equal(back[k], v) for k, v in model.state_dict().items())
    _stop_background_process()
    return out


def _stop_background_process() -> None:
    """End DCP's background process now, as its finaliser does (a message, then a join),
    rather than at ``os._exit``, where it would see its pipe closed and print an error."""
    import gc

    from torch.distributed.checkpoint import _async_process_executor as executor

    executor._CHECKPOINT_PROCESS = None
    gc.collect()


def main() -> None:
    warnings.filterwarnings("ignore")
    directory, port = Path(sys.argv[1]), int(sys.argv[2])
    import torch.distributed as dist

    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        result = scenario(directory)
    except BaseException:
        result = {"error": traceback.format_exc()}
        code = 1
    (directory / "result.json").write_text(json.dumps(result, indent=1))
    with contextlib.suppress(Exception):  # the result is written; nothing else to do
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
