"""The commit protocol: how a save claims its location, writes, and commits or cleans up.

A checkpoint exists once its root ``zarr.json`` is written, and only then (spec section
"Commit"). Every writer of this library (``ucpformat.save``,
:func:`~ucpformat.checkpoint.adopt.adopt`,
:class:`~ucpformat.checkpoint.streaming.StreamingWriter` and the distributed pipeline,
:mod:`ucpformat.distributed.pipeline`) drives its location through these calls, in this
order:

1. :func:`mark_destination` - refuse a location that must not be written, before
   changing anything (UCP-1.0-R049); else hold it: the in-progress marker is the save's
   claim (UCP-1.0-R056, UCP-1.0-R059; locked for the whole save on a local file system).
   A committed checkpoint being replaced stays committed (``claim.replacing``).
   Given up here, :func:`unmark_destination` withdraws the claim.
2. :func:`clear_destination` - un-commit the checkpoint being replaced (its root deleted
   durably, UCP-1.0-R053) and remove everything but the marker.
   (:func:`prepare_destination` is 1 then 2.)
3. the writes - every stored object created, never replacing one that is there
   (:func:`create_owned`: one that is there was written by another writer during this
   save, which fails unless this save still holds the location).
4. :func:`commit_checkpoint` - node metadata, the manifest, and last the root, written
   only while the claim still holds the location; then the marker is removed and the
   location released. (Its last step, :func:`write_root`, serves a writer that has the
   documents' bytes already: ``ucpformat.pack`` copies a checkpoint byte for byte.)

On any failure after step 1, :func:`explain_failure` (a context manager around the
steps) calls :func:`abandon`: before step 2 it only withdraws the marker (a checkpoint
being replaced is as it was); after, it removes what the save wrote, the marker last, and
the error says what the location holds now. :func:`delete_checkpoint` removes a
checkpoint, or a failed save's remains, under the same claim.

How a stored object's bytes are encoded is the array engine's
(:mod:`ucpformat.engine.write`); the loop that writes them is
:mod:`ucpformat.checkpoint.write_loop`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from ucpformat._version import __version__
from ucpformat.checkpoint.metadata import (
    FORMAT_VERSION,
    IN_PROGRESS_KEY,
    MANIFEST_KEY,
    ZARR_JSON,
    ArrayMeta,
    GroupMeta,
    dumps,
    encode_root,
    utc_now,
)
from ucpformat.engine.write import StoredObject
from ucpformat.errors import (
    CheckpointExistsError,
    ConcurrentWriteError,
    UCPError,
    WriteError,
)
from ucpformat.store import Store, StoreClaim, is_safe_key


@dataclass
class WriteClaim:
    """A save's hold on its location, from :func:`mark_destination` until :func:`commit_checkpoint`
    or :func:`abandon` (UCP-1.0-R059): the token its in-progress marker carries, and the
    store's lock where the store has locks."""

    token: str
    held: StoreClaim
    #: A committed checkpoint is here, for this save to replace (``overwrite=True``); it
    #: stays committed until :func:`clear_destination`.
    replacing: bool = False
    #: :func:`clear_destination` has begun: from then on a failure removes what is here
    #: (:func:`abandon`); before, the location is as it was but for the marker.
    clearing: bool = False
    #: A committed checkpoint was here and this save un-committed it (``overwrite=True``).
    replaced: bool = False
    #: Committed, or abandoned: the location is no longer held.
    done: bool = False


#: The claim of the save in progress on each store of this process (so that commit and
#: abandon find the claim mark_destination took, whoever calls them).
_CLAIMS: weakref.WeakKeyDictionary[Store, WriteClaim] = weakref.WeakKeyDictionary()
#: The bytes of a marker read to describe its writer.
_MARKER_READ_LIMIT = 64 << 10


def prepare_destination(store: Store, *, overwrite: bool) -> WriteClaim:
    """Make ``store`` ready for a new checkpoint and hold it, or refuse (never damaging a
    committed one): :func:`mark_destination`, then :func:`clear_destination`.

    Returns the claim; :func:`commit_checkpoint` checks it before it writes the root and
    releases it, and :func:`abandon` (called by every writer of this library when a save
    fails) removes what the save wrote.
    """
    claim = mark_destination(store, overwrite=overwrite)
    clear_destination(store, claim)
    return claim


def mark_destination(store: Store, *, overwrite: bool) -> WriteClaim:
    """The first half of :func:`prepare_destination`: refuse, or hold the location.

    Everything that can refuse the save is checked before anything changes (UCP-1.0-R049),
    and again once the location is claimed, in the order of UCP-1.0-R065:
    a committed checkpoint without ``overwrite``, files that are not a checkpoint's, names
    the writer could not remove. Then the in-progress marker (UCP-1.0-R056) is written as this
    save's claim (UCP-1.0-R059): a second writer is refused while the first runs (on a
    local file system the marker is locked for the whole save; on an object store a marker
    already there is taken over only with ``overwrite``). Then the checks are repeated. A
    committed checkpoint being replaced stays committed (UCP-1.0-R053) until
    :func:`clear_destination` (``claim.replacing`` says whether one is here); a save given
    up before that withdraws its claim with :func:`unmark_destination` (or
    :func:`abandon`), and the location is as it was.
    """
    _check_destination(store, overwrite=overwrite)  # refuse before touching anything
    held = hold_location(store, token := uuid.uuid4().hex, take_over=overwrite)
    claim = WriteClaim(token, held)
    try:  # again, now that no other writer can change the location
        claim.replacing, _ = _check_destination(store, overwrite=overwrite)
    except BaseException:
        with contextlib.suppress(OSError, UCPError):
            unmark_destination(store, claim)
        raise
    _CLAIMS[store] = claim
    return claim


def clear_destination(store: Store, claim: WriteClaim) -> None:
    """The second half of :func:`prepare_destination`, after :func:`mark_destination`:
    un-commit the checkpoint being replaced (its root deleted durably, UCP-1.0-R053), then remove
    all but the marker. A failure abandons the save (:func:`explain_failure`)."""
    with explain_failure(store, claim):
        if not claim.held.locked:  # without a lock, only the marker says who holds it
            _check_owner(store, claim)
        # Marked first (mark_destination), then un-commit, then clear: a crash at any
        # point leaves either the old committed checkpoint intact or something every
        # reader refuses.
        keys = list(store.list())
        claim.clearing = True
        if ZARR_JSON in keys:
            store.delete(ZARR_JSON)
            claim.replaced = True
        store.delete_keys(
            [k for k in keys if k not in (IN_PROGRESS_KEY, ZARR_JSON) and is_safe_key(k)]
        )
        store.flush()


def unmark_destination(store: Store, claim: WriteClaim) -> None:
    """Withdraw the claim of a save given up between :func:`mark_destination` and
    :func:`clear_destination`: its marker is removed (unless it replaced the marker of an
    earlier save, whose remains it still marks) and the location released. A checkpoint
    it was to replace is then as it was."""
    if claim.done:
        return
    try:
        if not claim.held.took_over and (claim.held.locked or _owns(store, claim)):
            store.delete(IN_PROGRESS_KEY)
    finally:
        claim.done = True
        release(store, claim)


def check_destination(store: Store, *, overwrite: bool) -> None:
    """Refuse, changing nothing, a location that a save must not write (step 1 of
    UCP-1.0-R065): a committed checkpoint without ``overwrite``, files that are not a
    checkpoint's, names the writer could not remove. For a writer with long work before
    its claim (``ucpformat.unpack`` validates its source first), so that it is refused
    at once; :func:`mark_destination` checks again once it holds the location, and only
    that check decides that the save goes ahead."""
    _check_destination(store, overwrite=overwrite)


def _check_destination(store: Store, *, overwrite: bool) -> tuple[bool, list[str]]:
    """(whether a checkpoint is committed here, every key here), or the refusal."""
    keys = list(store.list())
    committed = ZARR_JSON in keys
    if committed and not overwrite:
        raise CheckpointExistsError(
            "a committed checkpoint is already here; pass overwrite=True to replace it",
            rule="UCP-1.0-R053",
            path=store.location,
        )
    if keys and IN_PROGRESS_KEY not in keys and not (committed and holds_checkpoint(store)):
        # overwrite=True replaces a checkpoint; it never deletes a directory of other files
        # (UCP-1.0-R066). Beside a committed checkpoint, files with names no checkpoint has
        # are refused below; others are removed with the checkpoint it replaces.
        raise CheckpointExistsError(
            "the destination holds files that are not a UCP checkpoint (the first: "
            f"{sorted(keys)[0]!r}); refusing to mix them with a checkpoint or to delete them "
            "(even with overwrite=True)",
            rule="UCP-1.0-R053",
            path=store.location,
        )
    unsafe = sorted(k for k in keys if not is_safe_key(k))
    if unsafe:
        raise CheckpointExistsError(
            f"{len(unsafe)} file(s) here have names that no checkpoint file has, so the writer "
            f"will not remove them (the first: {unsafe[0]!r}); remove them and save again. "
            "Nothing was changed",
            rule="UCP-1.0-R049",
            path=store.location,
        )
    return committed, keys


def hold_location(store: Store, token: str, *, take_over: bool, keep: bool = False
                  ) -> StoreClaim:
    """The store's claim on the location, its marker carrying ``token`` (or, if ``keep``,
    a marker already there kept as it is); refused with a ConcurrentWriteError naming the
    writer that holds it."""
    try:
        return store.claim(IN_PROGRESS_KEY, _in_progress_marker(token), take_over=take_over,
                           keep=keep)
    except BlockingIOError:
        raise ConcurrentWriteError(
            f"another writer is saving here ({_describe_marker(store)}) and holds the "
            "location until it ends; nothing was changed",
            rule="UCP-1.0-R059", path=store.location,
        ) from None
    except FileExistsError:
        raise ConcurrentWriteError(
            f"a save is in progress here, or stopped before it ended "
            f"({_describe_marker(store)}): this store cannot tell which. If no other writer "
            "is saving here, pass overwrite=True to take the location over; nothing was "
            "changed",
            rule="UCP-1.0-R059", path=store.location,
        ) from None


def _in_progress_marker(token: str) -> bytes:
    return dumps(
        {
            "writer": f"ucpformat {__version__}",
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": utc_now(),
            "token": token,
        }
    )


def _marker(store: Store) -> Mapping[str, Any] | None:
    """The in-progress marker's document, or None if it is absent or not one."""
    try:
        raw = store.get_range(IN_PROGRESS_KEY, 0, _MARKER_READ_LIMIT)
        doc = json.loads(raw or b"")
    except (ValueError, OSError, UCPError):
        return None
    return doc if isinstance(doc, Mapping) else None


def _describe_marker(store: Store) -> str:
    doc = _marker(store)
    if doc is None:
        return "its marker says nothing more"
    said = [f"{k} {str(doc[k])[:80]}" for k in ("writer", "host", "pid", "started") if k in doc]
    return ", ".join(said) or "its marker says nothing more"


def _owns(store: Store, claim: WriteClaim) -> bool:
    """True if the in-progress marker still carries this claim's token."""
    doc = _marker(store)
    return doc is not None and doc.get("token") == claim.token


def _check_owner(store: Store, claim: WriteClaim) -> None:
    if not _owns(store, claim):
        raise ConcurrentWriteError(
            f"another writer took this location over during this save (its marker: "
            f"{_describe_marker(store)}); this save commits nothing",
            rule="UCP-1.0-R059", path=store.location,
        )


def holds_checkpoint(store: Store) -> bool:
    """True if the root zarr.json is a UCP root (a JSON object with ``attributes.ucp``)."""
    raw = store.get(ZARR_JSON)
    try:
        doc = json.loads(raw or b"")
    except ValueError:
        return False
    attrs = doc.get("attributes") if isinstance(doc, Mapping) else None
    return isinstance(attrs, Mapping) and isinstance(attrs.get("ucp"), Mapping)


def commit_checkpoint(
    store: Store,
    *,
    arrays: Sequence[ArrayMeta],
    groups: Sequence[GroupMeta],
    objects: Sequence[StoredObject],
    root_ucp: Mapping[str, Any],
    root_attributes: Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    claim: WriteClaim | None = None,
    replace: bool = False,
) -> dict[str, Any]:
    """Write node metadata, the manifest and, last, the root: the checkpoint exists after this.

    ``claim`` (default: the one :func:`mark_destination` took on ``store``) is checked
    before the root is written: a save whose location another writer took over commits
    nothing (UCP-1.0-R059). Metadata documents are created, as stored objects are, unless
    ``replace`` (:func:`adopt`: the node documents and a plain zarr root of the arrays'
    writer are there, and are rewritten). Returns the root ``zarr.json`` document.
    """
    if claim is None:
        claim = claim_of(store)
    files: dict[str, dict[str, Any]] = {o.key: o.to_json() for o in objects}
    consolidated: dict[str, Any] = {}
    nodes: list[ArrayMeta | GroupMeta] = [*groups, *arrays]
    bodies: list[tuple[str, bytes]] = []
    for node in sorted(nodes, key=lambda n: n.path):
        doc = node.to_zarr_json()
        body = dumps(doc)
        bodies.append((f"{node.path}/{ZARR_JSON}", body))
        files[f"{node.path}/{ZARR_JSON}"] = describe_file(body, hash_algorithm)
        consolidated[node.path] = doc
    # Creating files is system calls (the GIL is released): a few threads overlap them.
    def write(key: str, body: bytes) -> None:
        if replace:
            store.put(key, [body])
        else:
            create_owned(store, claim, key, lambda: store.create(key, [body]))

    ucp = dict(root_ucp)
    ucp["version"] = FORMAT_VERSION
    attributes = dict(root_attributes or {})
    attributes["ucp"] = ucp
    manifest = {
        "hash_algorithm": hash_algorithm,
        # A copy of the root's attributes (but the manifest reference): the manifest's
        # digest in the root seals it, so damage to the root's own values is detectable
        # (UCP-1.0-R045); everything else in the root is sealed by the node documents.
        "root_attributes": attributes,
        "files": dict(sorted(files.items())),
    }
    manifest_body = dumps(manifest)
    # held until everything but the root is durable (the root is written through the
    # location's path, after the claim is checked there)
    with store.batch():
        with ThreadPoolExecutor(min(8, max(1, len(bodies)))) as pool:
            for _ in pool.map(lambda kb: write(*kb), bodies):
                pass
        write(MANIFEST_KEY, manifest_body)
        store.flush()  # every byte before the commit is durable before it is written
    ucp = {**ucp, "manifest": {"path": MANIFEST_KEY, **describe_file(manifest_body, "sha256")}}
    attributes = {**attributes, "ucp": ucp}
    root = {
        "zarr_format": 3,
        "node_type": "group",
        "attributes": attributes,
        "consolidated_metadata": {
            "kind": "inline", "must_understand": False, "metadata": consolidated
        },
    }
    body = encode_root(root)  # sealed by its digest (UCP-1.0-R058)
    write_root(store, body, written=files, claim=claim, replace=replace)
    return root


def write_root(
    store: Store,
    body: bytes,
    *,
    written: Iterable[str],
    claim: WriteClaim | None = None,
    replace: bool = False,
) -> None:
    """The last steps of a save (spec section 11.1, steps 6 and 7): write the root
    ``zarr.json`` (``body``, its bytes, sealed), which commits the checkpoint, then remove
    the in-progress marker and release the location.

    The caller has written every other file of the checkpoint (``written``: their keys,
    but the manifest's) and made them durable (``store.flush()``, UCP-1.0-R050).
    :func:`commit_checkpoint` calls it with the documents it built; ``ucpformat.pack`` and
    ``unpack`` with a committed checkpoint's root, copied byte for byte. ``claim``
    (default: the one :func:`mark_destination` took on ``store``) is checked before the
    root is written (UCP-1.0-R059), which then replaces no root (UCP-1.0-R064): on a store
    without a lock, the location must hold nothing but ``written``, the manifest and the
    marker.
    """
    if claim is None:
        claim = claim_of(store)
    if claim is None:
        store.put(ZARR_JSON, [body], atomic=True)
    else:
        _commit_root(store, claim, body, expected={*written, MANIFEST_KEY, IN_PROGRESS_KEY},
                     replace=replace)
    try:
        if claim is None or claim.held.locked or _owns(store, claim):
            store.delete(IN_PROGRESS_KEY)  # never another writer's marker (UCP-1.0-R059)
    except OSError as exc:
        raise WriteError(
            f"the checkpoint is committed, but its in-progress marker could not be removed "
            f"({exc}); readers accept the checkpoint, validators warn (UCP-1.0-R056)",
            path=store.location,
        ) from exc
    finally:
        release(store, claim)


def _commit_root(store: Store, claim: WriteClaim, body: bytes, *, expected: set[str],
                 replace: bool) -> None:
    """Write the root if this save still holds the location (UCP-1.0-R059), in a step that
    replaces no checkpoint's root (UCP-1.0-R064).

    With a lock (a local file system), checking the marker's token suffices. Without one
    (object stores), the location must also hold no object this save did not write, the
    root is created conditionally, and the token is checked once more after it: a writer
    that lost the location in between deletes the root it has just written, if it is
    still its own.
    """
    _check_owner(store, claim)
    if claim.held.locked:
        store.put(ZARR_JSON, [body], atomic=True)
        claim.done = True
        return
    foreign = sorted(k for k in store.list() if k not in expected)
    if foreign and foreign != [ZARR_JSON]:
        raise ConcurrentWriteError(
            f"{len(foreign)} object(s) that this save did not write are in its location (the "
            f"first: {foreign[0]!r}): another writer wrote there; this save commits nothing",
            rule="UCP-1.0-R059", path=store.location,
        )
    if replace:
        store.put(ZARR_JSON, [body], atomic=True)
    else:
        create_owned(store, claim, ZARR_JSON,
                     lambda: store.create(ZARR_JSON, [body], atomic=True))
    if not _owns(store, claim):
        if store.get(ZARR_JSON) == body:  # ours, written just now: un-commit it
            store.delete(ZARR_JSON)
        _check_owner(store, claim)
    claim.done = True


_T = TypeVar("_T")


def create_owned(store: Store, claim: WriteClaim | None, key: str, create: Callable[[], _T]
                 ) -> _T:
    """Run ``create`` (a create-only write of ``key``). If ``key`` is already there, it was
    put there by another writer during this save: if this save still holds the location,
    that writer was displaced by it and its object is removed and ``create`` run again;
    otherwise ConcurrentWriteError (UCP-1.0-R059)."""
    try:
        return create()
    except FileExistsError as exc:
        if claim is None:
            raise ConcurrentWriteError(
                f"{key} was written by another writer during this save",
                rule="UCP-1.0-R059", path=store.location,
            ) from exc
        if not _owns(store, claim):
            raise ConcurrentWriteError(
                f"another writer took this location over during this save ({key} is its; "
                f"its marker: {_describe_marker(store)}); this save commits nothing",
                rule="UCP-1.0-R059", path=store.location,
            ) from exc
    store.delete(key)
    try:
        return create()
    except FileExistsError as exc:
        raise ConcurrentWriteError(
            f"{key} was written by another writer during this save, twice",
            rule="UCP-1.0-R059", path=store.location,
        ) from exc


def release(store: Store, claim: WriteClaim | None) -> None:
    if claim is None:
        return
    claim.held.release()
    if claim_of(store) is claim:
        del _CLAIMS[store]


def abandon(store: Store, claim: WriteClaim | None = None) -> str:
    """Undo a save that will not be committed: remove what it wrote and, last, its marker,
    if the location is still its own, and release the location (UCP-1.0-R049).

    ``claim`` defaults to the one :func:`mark_destination` took on ``store``. Returns
    what became of the location, as a sentence for an error message. Removes nothing once
    the save has committed, or if another writer has taken the location over; before
    :func:`clear_destination` began, only withdraws the marker
    (:func:`unmark_destination`): a checkpoint being replaced stays as it was (UCP-1.0-R053).
    """
    if claim is None:
        claim = claim_of(store)
    if claim is None or claim.done:
        return ""
    if not claim.clearing:
        try:
            unmark_destination(store, claim)
        except (OSError, UCPError) as exc:
            return f"its in-progress marker {IN_PROGRESS_KEY} could not be removed ({exc})"
        return "the checkpoint that was here is as it was" if claim.replacing else ""
    try:
        if not _owns(store, claim):
            return "another writer has taken the location over, so nothing of it was removed"
        store.delete_keys(
            [k for k in store.list() if k != IN_PROGRESS_KEY and is_safe_key(k)]
        )
        store.flush()
        store.delete_all()  # what is left: empty directories and, last, the marker
    except (OSError, UCPError) as exc:
        return (
            f"its partial files could not all be removed ({exc}): they remain at "
            f"{store.location}, with the marker {IN_PROGRESS_KEY} that every reader refuses; "
            "the next save to that location removes them"
        )
    finally:
        claim.done = True
        release(store, claim)
    return "the files it had written were removed"


@contextlib.contextmanager
def explain_failure(store: Store, claim: WriteClaim) -> Iterator[None]:
    """On any failure inside: :func:`abandon` the save, and say in the error what the
    location holds now (nothing committed; the replaced checkpoint gone; its files
    removed, or where they are)."""
    try:
        yield
    except BaseException as exc:
        if claim.done:
            raise
        fate = abandon(store, claim)
        said = "nothing was committed" in str(exc)  # a distributed save's agreement says so
        lead = "" if said else "nothing was committed"
        if claim.replaced:
            lead = (
                f"{lead}{', and ' if lead else ''}the checkpoint that was here is gone: this "
                "save deleted it when it began (overwrite=True, UCP-1.0-R053), so the "
                "location holds no checkpoint now"
            )
        text = "; ".join(t for t in (lead, fate) if t)
        if isinstance(exc, OSError):
            raise WriteError("; ".join(t for t in (f"the save failed: {exc}", text) if t),
                             path=store.location) from exc
        if text and isinstance(exc, UCPError):
            exc.extend(text)
        elif text:
            exc.add_note(f"ucpformat: {text}")
        raise


def delete_checkpoint(store: Store) -> None:
    """Delete the checkpoint, or the remains of a save, at ``store``.

    Refuses what is neither (files that are not a checkpoint's, names no checkpoint has:
    UCP-1.0-R049) and a location another writer holds (UCP-1.0-R059); then claims the location,
    un-commits (UCP-1.0-R053), removes every file, the marker last, and releases it. The marker
    of the remains of a save is claimed as it is, so that a full disk does not stop the
    deletion that frees it. Links are removed, never followed. The location's directory
    itself stays.
    """
    committed, keys = _check_destination(store, overwrite=True)
    if not keys:
        return
    keep = IN_PROGRESS_KEY in keys and not committed
    claim = WriteClaim(token := uuid.uuid4().hex,
                       hold_location(store, token, take_over=True, keep=keep))
    try:
        committed, keys = _check_destination(store, overwrite=True)
        if committed:
            store.delete(ZARR_JSON)
            store.flush()
        store.delete_keys([k for k in keys if k not in (IN_PROGRESS_KEY, ZARR_JSON)])
        store.flush()
        store.delete_all()
    finally:
        claim.done = True
        claim.held.release()


def describe_file(body: bytes, hash_algorithm: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"nbytes": len(body)}
    if hash_algorithm == "sha256":
        doc["sha256"] = hashlib.sha256(body).hexdigest()
    return doc




def claim_of(store: Store) -> WriteClaim | None:
    """The claim of the save in progress on ``store`` in this process (the one
    :func:`mark_destination` took), or None."""
    return _CLAIMS.get(store)


@contextlib.contextmanager
def storage_errors(store: Store, *, untouched: bool = False) -> Iterator[None]:
    """Report a failure of the storage (OSError) as a WriteError naming the checkpoint
    (``untouched``: and saying that nothing was changed); an object created by another
    writer during this save as a ConcurrentWriteError (UCP-1.0-R059)."""
    try:
        yield
    except UCPError:
        raise
    except FileExistsError as exc:
        raise ConcurrentWriteError(
            f"{exc.filename or 'an object'} was written by another writer during this save",
            rule="UCP-1.0-R059", path=store.location,
        ) from exc
    except OSError as exc:
        text = f"the save failed: {exc}" + ("; nothing was changed" if untouched else "")
        raise WriteError(text, path=store.location) from exc

