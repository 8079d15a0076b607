"""Check the built site in a real browser: ``python -m spec.site.check [SITE_DIR]``.

Headless Chromium (Debian's ``chromium``) opens the site from a local HTTP server, follows
every internal link from the first page on, and fails on any that does not resolve: a page
or file the server does not have, or a fragment (``ucp-1.0.html#UCP-1.0-R054``) that names
no element of the page as the browser built it. Every requirement anchor of the site, and
every requirement of the spec's chapters, is also visited as the fragment of its page, and
must be the ``:target`` there, a paragraph that starts with its identifier. The browser is
driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``): one browser for
the whole crawl, no other package needed.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run", "--disable-dev-shm-usage")
REQUIREMENT = re.compile(r"^UCP-\d+\.\d+-R\d{3,}$")
_COLLECT = """JSON.stringify({
  ids: Array.from(document.querySelectorAll('[id]'), e => e.id),
  links: Array.from(document.querySelectorAll('a[href]'), a => a.href),
  requirements: Object.fromEntries(Array.from(document.querySelectorAll('[id^="UCP-"]'),
      e => [e.id, e.textContent.trim().slice(0, 40)]))
})"""


def chromium() -> str | None:
    """The browser's command, or None if it is not installed."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


class _Handler(http.server.SimpleHTTPRequestHandler):
    statuses: dict[str, int]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_response(self, code: int, message: str | None = None) -> None:
        self.statuses[urllib.parse.urlsplit(self.path).path] = code
        super().send_response(code, message)


@contextlib.contextmanager
def _serve(site: Path) -> Iterator[tuple[str, dict[str, int]]]:
    statuses: dict[str, int] = {}
    handler = type("Handler", (_Handler,), {"statuses": statuses})
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(handler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", statuses
    finally:
        server.shutdown()
        server.server_close()


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe."""

    def __init__(self, command: str, timeout: float = 30.0) -> None:
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="ucp-site-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds() -> None:  # the browser reads fd 3 and writes fd 4
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        self._proc = subprocess.Popen(
            [command, *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=fds, close_fds=False)  # fds 3 and 4 are made in the child
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next = 0
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._pending: list[dict[str, Any]] = []
        threading.Thread(target=self._read, daemon=True).start()
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.call("Target.attachToTarget",
                                  {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                data = os.read(self._from_browser, 1 << 16)
            except OSError:
                data = b""
            if not data:
                self._messages.put(None)
                return
            buffer += data
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                self._messages.put(json.loads(raw))

    def _receive(self) -> dict[str, Any]:
        try:
            message = self._messages.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError("the browser did not answer in time") from None
        if message is None:
            raise RuntimeError("the browser ended")
        return message

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: bool = False) -> dict[str, Any]:
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._receive()
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result
            self._pending.append(reply)

    def _event(self, name: str) -> None:
        for i, event in enumerate(self._pending):
            if event.get("method") == name:
                del self._pending[: i + 1]
                return
        while True:
            if self._receive().get("method") == name:
                self._pending.clear()
                return

    def open(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        self._pending.clear()
        result = self.call("Page.navigate", {"url": url}, session=True)
        if result.get("errorText"):
            raise RuntimeError(f"{url}: {result['errorText']}")
        self._event("Page.loadEventFired")

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True}, session=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:60]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, url: str, *, width: int = 1280, height: int = 900) -> None:
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                  session=True)
        self.open(url)
        self.evaluate("new Promise(done => setTimeout(done, 1000))")  # the header settles
        data = self.call("Page.captureScreenshot", {"format": "png"}, session=True)["data"]
        import base64

        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            self.call("Browser.close")
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        for fd in (self._to_browser, self._from_browser):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_site(site: Path, *, expected: dict[str, list[str]] | None = None,
               command: str | None = None, start: str = "index.html") -> tuple[list[str], int]:
    """(every problem, the number of links and anchors checked). ``expected`` maps a page
    (``ucp-1.0.html``) to requirement ids that must be anchors on it."""
    command = command or chromium()
    if command is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    problems: list[str] = []
    with _serve(site) as (base, statuses), Browser(command) as browser:
        pages: dict[str, dict[str, Any]] = {}
        fragments: list[tuple[str, str, str]] = []  # (page, fragment, linked from)
        todo = [(urllib.parse.urljoin(base, start), "(start)")]
        checked = 0
        while todo:
            url, source = todo.pop(0)
            path = urllib.parse.urlsplit(url).path
            if path in pages:
                continue
            if not path.endswith(".html") and not path.endswith("/"):
                status = browser.evaluate(f"fetch({json.dumps(url)}).then(r => r.status)")
                pages[path] = {"ids": [], "requirements": {}}
                if status != 200:
                    problems.append(f"{source}: link to {path}: HTTP {status}")
                continue
            browser.open(url)
            status = statuses.get(path, 0)
            if status != 200:
                pages[path] = {"ids": [], "requirements": {}, "missing": True}
                problems.append(f"{source}: link to {path}: HTTP {status}")
                continue
            found = json.loads(browser.evaluate(_COLLECT))
            pages[path] = found
            for link in found["links"]:
                checked += 1
                if not link.startswith(base):
                    continue  # not the site's (none should be: the site is offline)
                target, _, fragment = link.partition("#")
                target_path = urllib.parse.urlsplit(target).path
                if fragment:
                    fragments.append((target_path, urllib.parse.unquote(fragment), path))
                todo.append((target, path))
        for target_path, fragment, source in fragments:
            page = pages.get(target_path)
            if page is None or page.get("missing"):
                continue  # reported above
            if fragment not in page["ids"]:
                problems.append(f"{source}: link to {target_path}#{fragment}: no element has "
                                f"this id")
        anchors = {(p, i) for p, data in pages.items() for i in data["requirements"]}
        anchors |= {(p, i) for p, _, i in ((t, None, f) for t, f, _ in fragments)
                    if REQUIREMENT.match(i)}
        for page, ids in (expected or {}).items():
            anchors |= {("/" + page, i) for i in ids}
        by_page: dict[str, list[str]] = {}
        for page, rid in anchors:
            by_page.setdefault(page, []).append(rid)
        for page, rids in sorted(by_page.items()):  # visit each as the page's fragment
            if pages.get(page, {}).get("missing"):
                continue
            browser.open(urllib.parse.urljoin(base, page.lstrip("/")))
            for rid in sorted(rids):
                checked += 1
                text = browser.evaluate(
                    f"(location.hash = {json.dumps('#' + rid)}, "
                    "(document.querySelector(':target') || {textContent: ''})"
                    ".textContent.trim().slice(0, 40))")
                if not str(text).startswith(rid):
                    problems.append(f"{page}#{rid}: the requirement's anchor does not resolve "
                                    f"to its text (the target starts {text!r})")
        for path, status in sorted(statuses.items()):
            if status >= 400:
                problems.append(f"{path}: HTTP {status} (a resource the pages load)")
    return sorted(set(problems)), checked


def screenshot(site: Path, out: Path, page: str = "ucp-1.0.html#UCP-1.0-R054") -> None:
    """A picture of ``page`` of the built site as a reader sees it (1280 x 900)."""
    command = chromium()
    if command is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    with _serve(site) as (base, _), Browser(command) as browser:
        browser.screenshot(out, urllib.parse.urljoin(base, page))


def main(argv: list[str] | None = None) -> int:
    """``[SITE_DIR]``: check the site; ``--screenshot PNG [SITE_DIR]``: take the picture of
    a requirement page that docs/ keeps."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--screenshot"]:
        site = Path(args[2]) if len(args) > 2 else Path(__file__).resolve().parents[2] / "site"
        screenshot(site, Path(args[1]))
        return 0
    site = Path(args[0]) if args else Path(__file__).resolve().parents[2] / "site"
    from spec.site import common

    expected = {page.replace(".md", ".html"): [r for r, (p, _) in reqs.items() if p == page]
                for reqs in [common.requirements(common.SPEC)] for page in common.CHAPTERS}
    problems, checked = check_site(site, expected=expected)
    for problem in problems:
        print(problem)
    print(f"{checked} links and anchors checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
