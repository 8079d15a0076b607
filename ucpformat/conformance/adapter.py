"""Running an adapter: the command-line contract of spec/ucp-1.0-conformance.md.

An adapter is a command (``CMD``, any language) that the suite runs with one of these
argument lists; it prints one JSON document on stdout and reports through its exit status:

* ``CMD capabilities`` -> capabilities (UCP-1.0-R230);
* ``CMD read CHECKPOINT REQUEST_JSON`` -> a response; exit 0 read, 1 refused (UCP-1.0-R231);
* ``CMD read-batch BATCH_JSON`` -> ``{"results": {id: response}}`` (UCP-1.0-R232, optional);
* ``CMD write SCENARIO_JSON OUT_DIR`` -> exit 0 once committed, non-zero otherwise (UCP-1.0-R233);
* ``CMD validate CHECKPOINT`` -> a validation result; exit 0 valid, 1 invalid (UCP-1.0-R234);
* ``CMD validate-rules RULES_JSON APPLY_JSON`` -> a validation result (UCP-1.0-R234, optional).

Exit status 2 (or any other) means the adapter itself failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT = 120.0


@dataclass
class Run:
    """One adapter process: what it printed and how it ended."""

    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool = False

    def json(self) -> Any:
        """The JSON document on stdout (ValueError if there is none)."""
        text = self.stdout.strip()
        if not text:
            raise ValueError("the adapter printed nothing on stdout")
        return json.loads(text)

    def describe(self) -> str:
        tail = self.stderr.strip().splitlines()[-3:]
        why = "timed out" if self.timed_out else f"exit status {self.returncode}"
        return f"`{shlex.join(self.argv)}`: {why}" + (f"; stderr: {' | '.join(tail)}" if tail
                                                       else "")


class Started:
    """An adapter process started in its own process group, still running (see
    :meth:`Adapter.start`): the writer suite stops and resumes it (``SIGSTOP``,
    ``SIGCONT``) to make two writes overlap (UCP-1.0-R065)."""

    def __init__(self, argv: list[str], proc: subprocess.Popen[str]) -> None:
        self.argv = argv
        self.proc = proc
        self.started = time.monotonic()

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the adapter's whole process group (its children too)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def finish(self, timeout: float | None) -> Run | None:
        """Wait for the process to end and return its run; None if it runs on past ``timeout``."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return Run(self.argv, self.proc.returncode, out, err, time.monotonic() - self.started)

    def kill(self) -> Run:
        """End the process group (resumed first, if stopped); a timed-out run."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        out, err = self.proc.communicate()
        return Run(self.argv, -1, out, err, time.monotonic() - self.started, timed_out=True)


class Adapter:
    """A reader, writer or validator adapter given as a command line."""

    def __init__(self, command: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike[str] | None = None
                 ) -> None:
        if not command:
            raise ValueError("an adapter needs a command")
        self.command = list(command)
        self.timeout = timeout
        self.env = dict(env) if env is not None else None
        self.cwd = cwd

    def __str__(self) -> str:
        return shlex.join(self.command)

    def run(self, *args: str, file_size_limit: int | None = None,
            timeout: float | None = None) -> Run:
        argv = [*self.command, *args]
        preexec: Callable[[], None] | None = None
        if file_size_limit is not None:
            limit = int(file_size_limit)

            def preexec() -> None:  # runs in the child, before exec (POSIX only)
                import resource

                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        env = None if self.env is None else {**os.environ, **self.env}
        start = time.monotonic()
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, encoding="utf-8", errors="replace",
                timeout=timeout or self.timeout, env=env, cwd=self.cwd, preexec_fn=preexec,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout if isinstance(exc.stdout, str) else (exc.stdout or b"").decode(
                "utf-8", "replace")
            err = exc.stderr if isinstance(exc.stderr, str) else (exc.stderr or b"").decode(
                "utf-8", "replace")
            return Run(argv, -1, out, err, time.monotonic() - start, timed_out=True)
        except OSError as exc:
            return Run(argv, -1, "", f"cannot run the adapter: {exc}", time.monotonic() - start)
        return Run(argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)

    def start(self, *args: str) -> Started | None:
        """Start the command without waiting for it, in a new process group (POSIX), so
        that it can be stopped and resumed as a whole; None if it cannot be started."""
        argv = [*self.command, *args]
        env = None if self.env is None else {**os.environ, **self.env}
        try:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                encoding="utf-8", errors="replace", env=env, cwd=self.cwd,
                start_new_session=True,
            )
        except OSError:
            return None
        return Started(argv, proc)

    # -- the contract ---------------------------------------------------------------------

    def capabilities(self) -> Run:
        return self.run("capabilities")

    def read(self, checkpoint: Path, request: Mapping[str, Any], workdir: Path) -> Run:
        path = _write_json(workdir, "request", request)
        return self.run("read", str(checkpoint), str(path))

    def read_batch(self, batch: Mapping[str, Any], workdir: Path, *,
                   timeout: float | None = None) -> Run:
        path = _write_json(workdir, "batch", batch)
        return self.run("read-batch", str(path), timeout=timeout)

    def write(self, scenario: Path, out_dir: Path, *, file_size_limit: int | None = None
              ) -> Run:
        return self.run("write", str(scenario), str(out_dir), file_size_limit=file_size_limit)

    def validate(self, checkpoint: Path) -> Run:
        return self.run("validate", str(checkpoint))

    def validate_rules(self, rules: Path, apply: Path) -> Run:
        return self.run("validate-rules", str(rules), str(apply))


def _write_json(workdir: Path, stem: str, doc: Mapping[str, Any]) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{stem}-", suffix=".json", dir=workdir)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)
    return Path(name)





class CallableAdapter(Adapter):
    """An adapter made of Python callables, for implementations tested in process.

    ``read(checkpoint, request) -> response``, ``write(scenario_json, out_dir)`` (raises
    to refuse) and ``validate(checkpoint) -> result`` follow the command-line contract's
    JSON documents; exceptions become exit status 1 with ``{"error": ...}``.
    """

    def __init__(
        self,
        name: str,
        *,
        capabilities: Mapping[str, Any],
        read: Callable[[Path, Mapping[str, Any]], Mapping[str, Any]] | None = None,
        write: Callable[[Path, Path], None] | None = None,
        validate: Callable[[Path], Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__([name])
        self._caps = dict(capabilities)
        self._read, self._write, self._validate = read, write, validate

    def __str__(self) -> str:
        return f"{self.command[0]} (in process)"

    def _call(self, argv: list[str], fn: Callable[[], Any], *, refused: Callable[[Any], bool]
              ) -> Run:
        start = time.monotonic()
        try:
            doc = fn()
            status = 1 if refused(doc) else 0
        except Exception as exc:
            error: dict[str, Any] = {"message": f"{type(exc).__name__}: {exc}"}
            rule = getattr(exc, "rule", None)
            if rule:
                error["rule"] = rule
            doc = {"error": error}
            status = 1
        return Run(argv, status, json.dumps(doc) if doc is not None else "", "",
                   time.monotonic() - start)

    def run(self, *args: str, file_size_limit: int | None = None,
            timeout: float | None = None) -> Run:
        return self._unavailable([*self.command, *args],
                                 "an in-process adapter has no command line")

    def start(self, *args: str) -> Started | None:
        return None  # no process to stop and resume

    def _unavailable(self, argv: list[str], why: str) -> Run:
        """What a command without this operation does: exit status 2, the reason on stderr."""
        return Run(argv, 2, "", f"{self}: {why}", 0.0)

    def capabilities(self) -> Run:
        return Run([*self.command, "capabilities"], 0, json.dumps(self._caps), "", 0.0)

    def read(self, checkpoint: Path, request: Mapping[str, Any], workdir: Path) -> Run:
        argv = [*self.command, "read", str(checkpoint), "-"]
        if self._read is None:
            return self._unavailable(argv, "no read callable was given")
        fn = self._read
        return self._call(argv,
                          lambda: fn(checkpoint, request),
                          refused=lambda doc: _has_error(doc))

    def read_batch(self, batch: Mapping[str, Any], workdir: Path, *,
                   timeout: float | None = None) -> Run:
        results = {}
        for item in batch["cases"]:
            run = self.read(Path(item["checkpoint"]), item["request"], workdir)
            results[item["id"]] = run.json()
        return Run([*self.command, "read-batch", "-"], 0, json.dumps({"results": results}), "",
                   0.0)

    def write(self, scenario: Path, out_dir: Path, *, file_size_limit: int | None = None
              ) -> Run:
        argv = [*self.command, "write", str(scenario), str(out_dir)]
        if self._write is None:
            return self._unavailable(argv, "no write callable was given")
        if file_size_limit is not None:
            return self._unavailable(argv, "file size limits need an adapter command")
        fn = self._write
        return self._call(argv,
                          lambda: fn(scenario, out_dir), refused=lambda doc: False)

    def validate(self, checkpoint: Path) -> Run:
        argv = [*self.command, "validate", str(checkpoint)]
        if self._validate is None:
            return self._unavailable(argv, "no validate callable was given")
        fn = self._validate
        return self._call(argv,
                          lambda: fn(checkpoint), refused=lambda doc: not doc.get("valid"))


def _has_error(doc: Any) -> bool:
    if not isinstance(doc, Mapping):
        return True
    if "error" in doc:
        return True
    for section in ("tensors", "targets"):
        for entry in (doc.get(section) or {}).values():
            if isinstance(entry, Mapping) and "error" in entry:
                return True
    return False


__all__ = ["DEFAULT_TIMEOUT", "Adapter", "CallableAdapter", "Run", "Started"]
