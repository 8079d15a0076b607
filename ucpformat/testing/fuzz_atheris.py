"""Coverage-guided fuzzing of the readers with atheris (libFuzzer for Python).

The same safety properties as :mod:`ucpformat.testing.hostile` (UCP-1.0-R097): each
input replaces one file of a small valid checkpoint - the root ``zarr.json``, an array's
``zarr.json`` (in both places), the manifest, or a stored object - and ``open``, a read of
every tensor and ``validate(deep=True)`` must either succeed or raise ``UCPError``.
Anything else (another exception, a crash of an extension, a hang, which libFuzzer's
``-timeout`` reports) is a finding, saved by libFuzzer as ``crash-<sha1>``.

Install atheris (``pip install atheris``, see pyproject's ``fuzz`` extra) and run::

    python -m ucpformat.testing.fuzz_atheris -atheris_runs=20000 -timeout=20 corpus/

``corpus/`` (created if missing) keeps interesting inputs between runs; every other
libFuzzer flag works too (``-max_len``, ``-jobs``). ``--seed-corpus DIR`` writes the
valid checkpoint's files as starting inputs. Reproduce a finding with
``python -m ucpformat.testing.fuzz_atheris crash-<sha1>``.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

#: The first byte of an input picks the file it replaces.
SLOTS = ("zarr.json", "model/fc.weight/zarr.json", "manifest.ucp.json", "model/fc.weight/c/0/0",
         "model/norm.scale/c/0")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    import atheris

    from ucpformat.checkpoint.reader import open_checkpoint
    from ucpformat.checkpoint.validation import validate
    from ucpformat.errors import UCPError
    from ucpformat.testing.hostile import make_fixture

    tmp = tempfile.TemporaryDirectory()
    fx = make_fixture(Path(tmp.name))
    root = fx.root

    if "--seed-corpus" in argv:
        i = argv.index("--seed-corpus")
        out = Path(argv[i + 1])
        out.mkdir(parents=True, exist_ok=True)
        for n, key in enumerate(SLOTS):
            (out / f"seed-{n}").write_bytes(bytes([n]) + fx.files[key])
        print(f"wrote {len(SLOTS)} seed inputs to {out}")
        return 0

    # ucpformat is imported already (``python -m`` imports the package first): instrument
    # every loaded module's code for coverage instead of instrumenting imports (slow: a
    # minute or two).
    atheris.instrument_all()

    def one_input(data: bytes) -> None:
        if not data:
            return
        key = SLOTS[data[0] % len(SLOTS)]
        path = root / key
        try:
            if key.endswith("fc.weight/zarr.json"):
                # keep the consolidated copy equal, so the array parser sees the bytes
                import json

                try:
                    node = json.loads(data[1:])
                except (ValueError, RecursionError):
                    node = None
                if node is not None:
                    doc = json.loads(fx.files["zarr.json"])
                    doc["consolidated_metadata"]["metadata"]["model/fc.weight"] = node
                    with contextlib.suppress(ValueError, RecursionError):
                        (root / "zarr.json").write_text(json.dumps(doc))
            path.write_bytes(data[1:])
            try:
                with open_checkpoint(root, max_read_bytes=8 << 20, workers=1) as ckpt:
                    for name in list(ckpt.arrays):
                        with contextlib.suppress(UCPError):
                            ckpt[name].read()
            except UCPError:
                pass
            validate(root, deep=True, max_read_bytes=8 << 20, workers=1)
        finally:
            for k in (key, "zarr.json"):
                (root / k).write_bytes(fx.files[k])

    atheris.Setup(argv, one_input)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main())
