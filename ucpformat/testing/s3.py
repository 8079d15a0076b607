"""A local S3-compatible server (moto's server mode) on loopback, for tests.

``with s3_server() as options:`` starts moto on 127.0.0.1 with a free port, creates the
bucket ``ucp-test`` and yields fsspec ``storage_options`` for s3fs that point at it, with
short timeouts and few retries (every request is bounded); the server stops on exit.
Nothing but 127.0.0.1 is ever contacted.

moto checks a conditional PUT (``If-None-Match: *``) and stores the object in two steps
that two of its request threads can interleave, so that two conditional PUTs of one key
both succeed and the later one wins. S3 lets the first to finish win and refuses the
other (412), and the one-writer-per-location guarantees on object stores (spec section
11.4) rest on that: the server started here makes moto's object writes one at a time.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

BUCKET = "ucp-test"
#: Held by every object write (PUT, POST, DELETE of a key) of the servers started here.
_OBJECT_WRITES = threading.Lock()


def serialise_object_writes() -> None:
    """Make moto's conditional writes atomic as S3's are: each PUT, POST (the completion
    of a multipart upload) and DELETE of an object runs alone (in this process)."""
    from moto.s3.responses import S3Response

    if getattr(S3Response, "_ucp_serialised", False):
        return
    for name in ("_key_response_put", "_key_response_post", "_key_response_delete"):
        original = getattr(S3Response, name)

        @functools.wraps(original)  # the original stays reachable as __wrapped__
        def one_at_a_time(self: Any, *args: Any, _original: Any = original, **kwargs: Any
                          ) -> Any:
            with _OBJECT_WRITES:
                return _original(self, *args, **kwargs)

        setattr(S3Response, name, one_at_a_time)
    S3Response._ucp_serialised = True  # type: ignore[attr-defined]


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, Any]]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    serialise_object_writes()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        assert host == "127.0.0.1"
        options = storage_options(f"http://127.0.0.1:{port}")
        import s3fs

        # moto keeps its buckets per process, not per server: a second server in the same
        # process (another test module) finds the bucket there already
        with contextlib.suppress(FileExistsError):
            s3fs.S3FileSystem(skip_instance_cache=True, **options).mkdir(BUCKET)
        yield options
    finally:
        server.stop()


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for a local endpoint: bounded requests, no retry storms."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {
            "connect_timeout": 5,
            "read_timeout": 30,
            "retries": {"max_attempts": 2, "mode": "standard"},
        },
    }


def crash_save(argv: list[str] | None = None) -> int:
    """Child of the crash tests: a save to S3 that a FaultyStore (or the parent) kills.

    ``python -m ucpformat.testing.s3 ENDPOINT URL SEED KILL_AT MODE DELAY``
    """
    import sys

    from ucpformat.checkpoint.writer import save
    from ucpformat.store.fsspec_store import FsspecStore
    from ucpformat.testing.common import SMALL_CHUNKING, small_state
    from ucpformat.testing.faults import FaultyStore

    endpoint, url, seed, kill_at, mode, delay = (argv or sys.argv[1:])[:6]
    store = FaultyStore(
        FsspecStore(url, storage_options=storage_options(endpoint)),
        kill_at=int(kill_at) if int(kill_at) >= 0 else None,
        mode=mode,
        delay=float(delay),
    )
    print("started", flush=True)
    save(store, small_state(int(seed)), compression="zstd", **SMALL_CHUNKING)
    print("finished", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(crash_save())
