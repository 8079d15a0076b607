"""Writing checkpoints: data first, metadata next, the root last (the commit).

The commit protocol (spec section "Commit"): a writer marks the directory as being
written, writes every stored object (shards or chunks) and every non-root ``zarr.json``,
then the manifest, and finally the root ``zarr.json`` with the consolidated metadata.
Until that last write succeeds, what is on disk is not a checkpoint and every reader
refuses it. A committed checkpoint is never modified; ``overwrite=True`` first
un-commits it (deletes the root) before anything else is touched.

This module holds the API (save, adopt, StreamingWriter, the commit); how a stored
object's bytes are encoded is the array engine's (:mod:`ucpformat.engine.write`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ucpformat import dtypes, jsonvalues, names
from ucpformat import feed as feeds
from ucpformat._version import __version__
from ucpformat.engine import chunking
from ucpformat.engine.compression import Compression
from ucpformat.engine.grid import object_coords, object_region, stored_object_coords
from ucpformat.engine.write import StoredObject, write_object
from ucpformat.errors import (
    CheckpointExistsError,
    ConcurrentWriteError,
    InvalidValueError,
    MissingChunkError,
    UCPError,
    WriteError,
)
from ucpformat.metadata import (
    FORMAT_VERSION,
    IN_PROGRESS_KEY,
    MANIFEST_KEY,
    RESERVED_GROUPS,
    RESERVED_ROOT_SUFFIX,
    ZARR_JSON,
    ArrayMeta,
    GroupMeta,
    build_root_ucp,
    dumps,
    encode_root,
    loads,
    parse_array,
    parse_group,
    utc_now,
)
from ucpformat.storage import Store, StoreClaim, is_safe_key, open_store

HASH_ALGORITHMS = ("sha256",)


# -- the commit protocol -----------------------------------------------------------------


@dataclass
class WriteClaim:
    """A save's hold on its location, from :func:`mark_destination` until :func:`commit`
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

    Returns the claim; :func:`commit` checks it before it writes the root and releases it,
    and :func:`abandon` (called by every writer of this library when a save fails) removes
    what the save wrote.
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
    held = _hold(store, token := uuid.uuid4().hex, take_over=overwrite)
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
        _release(store, claim)


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
    if keys and IN_PROGRESS_KEY not in keys and not (committed and _holds_checkpoint(store)):
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


def _hold(store: Store, token: str, *, take_over: bool, keep: bool = False) -> StoreClaim:
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


def _holds_checkpoint(store: Store) -> bool:
    """True if the root zarr.json is a UCP root (a JSON object with ``attributes.ucp``)."""
    raw = store.get(ZARR_JSON)
    try:
        doc = json.loads(raw or b"")
    except ValueError:
        return False
    attrs = doc.get("attributes") if isinstance(doc, Mapping) else None
    return isinstance(attrs, Mapping) and isinstance(attrs.get("ucp"), Mapping)


def commit(
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
        claim = _CLAIMS.get(store)
    files: dict[str, dict[str, Any]] = {o.key: o.to_json() for o in objects}
    consolidated: dict[str, Any] = {}
    nodes: list[ArrayMeta | GroupMeta] = [*groups, *arrays]
    bodies: list[tuple[str, bytes]] = []
    for node in sorted(nodes, key=lambda n: n.path):
        doc = node.to_zarr_json()
        body = dumps(doc)
        bodies.append((f"{node.path}/{ZARR_JSON}", body))
        files[f"{node.path}/{ZARR_JSON}"] = _describe(body, hash_algorithm)
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
    ucp = {**ucp, "manifest": {"path": MANIFEST_KEY, **_describe(manifest_body, "sha256")}}
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
    if claim is None:
        store.put(ZARR_JSON, [body], atomic=True)
    else:
        _commit_root(store, claim, body, expected={*files, MANIFEST_KEY, IN_PROGRESS_KEY},
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
        _release(store, claim)
    return root


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


def _release(store: Store, claim: WriteClaim | None) -> None:
    if claim is None:
        return
    claim.held.release()
    if _CLAIMS.get(store) is claim:
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
        claim = _CLAIMS.get(store)
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
        _release(store, claim)
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
                       _hold(store, token, take_over=True, keep=keep))
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


def _describe(body: bytes, hash_algorithm: str | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"nbytes": len(body)}
    if hash_algorithm == "sha256":
        doc["sha256"] = hashlib.sha256(body).hexdigest()
    return doc


# -- planning a save from a nested mapping ------------------------------------------------


@dataclass
class Plan:
    """What a save writes: array metadata with its data, groups, root values.

    ``root_values`` are the JSON values of the root as given (checked); the values of
    other groups are in their ``GroupMeta``, encoded.
    """

    arrays: list[tuple[ArrayMeta, ArrayValue]] = field(default_factory=list)
    groups: list[GroupMeta] = field(default_factory=list)
    root_values: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m, _ in self.arrays)


class Group(dict[str, Any]):
    """A mapping that ``save`` always stores as a group, even when it holds no array.

    A plain mapping becomes a group only if it holds an array somewhere; otherwise it is
    a JSON value of its parent. Wrap it in ``Group`` where the layout needs a group (for
    example ``optimizer/state/<parameter>`` whose state has no tensor). The top-level
    names ``model``, ``optimizer`` and ``training`` are always groups.

    ``ucp`` holds further members of the group's ``attributes.ucp`` (``aliases`` of tied
    tensors, UCP-1.0-R108); its ``values`` are the mapping's JSON entries.
    """

    def __init__(self, *args: Any, ucp: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if ucp is not None and "values" in ucp:
            raise InvalidValueError("a Group's JSON values are its entries, not ucp['values']")
        self.ucp: dict[str, Any] = dict(ucp or {})


def _has_array(value: Any) -> bool:
    """True if ``value`` must be stored as a group (it holds an array or a Group)."""
    if isinstance(value, np.ndarray | np.generic | Group | feeds.Deferred):
        return True
    if isinstance(value, Mapping):
        return any(_has_array(v) for v in value.values())
    return False


#: An array's values, or a placeholder whose values a :class:`ucpformat.feed.Feed` gives.
ArrayValue = np.ndarray[Any, Any] | feeds.Deferred
ArrayAttributes = Callable[[str, ArrayValue], Mapping[str, Any] | None]


def plan(
    state: Mapping[str, Any],
    *,
    compression: str | Mapping[str, Any] | None = None,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    array_attributes: ArrayAttributes | None = None,
) -> Plan:
    """Turn a nested mapping into the arrays and groups of a checkpoint.

    Arrays (numpy arrays and numpy scalars) become zarr arrays; mappings that contain an
    array (or a :class:`Group`) somewhere become groups, as do the reserved top-level
    mappings ``model``, ``optimizer`` and ``training``; every other value must be JSON and
    is stored in its group's ``attributes.ucp.values``.
    """
    if not isinstance(state, Mapping):
        raise InvalidValueError(f"the state must be a mapping, got {type(state).__name__}")
    result = Plan()

    def visit(mapping: Mapping[str, Any], prefix: str, group_values: dict[str, Any]) -> None:
        node_names = []
        for key, value in mapping.items():
            where = f"{prefix}/{key}" if prefix else str(key)
            node = names.escape(key, where=where) if isinstance(key, str) else None
            if node is None:
                raise InvalidValueError(
                    f"keys must be strings, got {type(key).__name__} {key!r}", path=where,
                    rule="UCP-1.0-R011",
                )
            if not prefix and node.lower().endswith(RESERVED_ROOT_SUFFIX):
                raise InvalidValueError(
                    f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                    rule="UCP-1.0-R004",
                    path=where,
                )
            reserved_group = not prefix and key in RESERVED_GROUPS
            if reserved_group and not isinstance(value, Mapping):
                raise InvalidValueError(
                    f"{key!r} is a reserved group: give it a mapping, not "
                    f"{type(value).__name__}",
                    rule="UCP-1.0-R004",
                    path=where,
                )
            path = f"{prefix}/{node}" if prefix else node
            if isinstance(value, np.ndarray | np.generic | feeds.Deferred):
                arr = value if isinstance(value, feeds.Deferred) else np.asarray(value)
                attrs = dict(array_attributes(path, arr) or {}) if array_attributes else {}
                result.arrays.append(
                    (_array_meta(path, arr, compression, chunk_bytes, shard_bytes, attrs), arr)
                )
                node_names.append(node)
            elif isinstance(value, Mapping) and (reserved_group or _has_array(value)):
                sub_values: dict[str, Any] = {}
                visit(value, path, sub_values)
                ucp = (
                    jsonvalues.encode(value.ucp, where=f"{where}.ucp")
                    if isinstance(value, Group) else {}
                )
                if sub_values:
                    ucp["values"] = sub_values
                result.groups.append(GroupMeta(path, {"ucp": ucp} if ucp else {}))
                node_names.append(node)
            else:
                if _looks_like_tensor(value):
                    raise InvalidValueError(
                        f"{type(value).__name__} is not a numpy array; convert tensors first "
                        "(ucpformat.torch does this for torch tensors)",
                        path=where,
                    )
                if key == jsonvalues.FLOAT_TAG:
                    raise InvalidValueError(
                        f"the key {jsonvalues.FLOAT_TAG!r} is reserved for non-finite floats",
                        rule="UCP-1.0-R070",
                        path=where,
                    )
                encoded = jsonvalues.encode(value, where=where)
                # the root's values are stored as given: build_root_ucp encodes them (a bad
                # one is refused here all the same, named by its key)
                group_values[key] = encoded if prefix else value
        names.check_case_collisions(node_names, parent=prefix)

    visit(state, "", result.root_values)
    return result


def _looks_like_tensor(value: Any) -> bool:
    return hasattr(value, "__array__") or hasattr(value, "__dlpack__")


def _array_meta(
    path: str,
    arr: ArrayValue,
    compression: str | Mapping[str, Any] | None,
    chunk_bytes: int,
    shard_bytes: int,
    attributes: Mapping[str, Any],
) -> ArrayMeta:
    dt = dtypes.from_numpy(arr.dtype, tensor=path)
    ucp = attributes.get("ucp", {})
    ch = chunking.choose(
        arr.shape,
        dt.itemsize,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        split_dims=chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {}),
    )
    meta = ArrayMeta(
        path=path,
        shape=tuple(int(s) for s in arr.shape),
        dtype=dt,
        chunk_shape=ch.chunk_shape,
        shard_shape=ch.shard_shape,
        compression=Compression.parse(compression, dt),
        fill_value=zero_bits(dt),
        attributes=attributes,
    )
    # Write nothing a reader would refuse (a bad attribute, a chunking bug): check first.
    parse_array(path, json.loads(dumps(meta.to_zarr_json(), compact=True)))
    return meta


def zero_bits(dt: dtypes.DataType) -> Any:
    """The value whose bits are all zero: the fill value ucpformat writes for every type
    (UCP-1.0-R033)."""
    return np.frombuffer(bytes(dt.itemsize), dtype=dt.numpy)[0]


# -- save ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SaveResult:
    """What a save wrote."""

    location: str
    tensors: int
    nbytes: int
    objects: int


ProgressCallback = Callable[[int], None]


def save(
    path: str | os.PathLike[str] | Store,
    state: Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    compression: str | Mapping[str, Any] | None = None,
    hash_algorithm: str | None = None,
    overwrite: bool = False,
    chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
    shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
    workers: int | None = None,
    durable: bool = True,
    progress: bool | ProgressCallback = False,
    array_attributes: ArrayAttributes | None = None,
    created: str | None = None,
    producer: Mapping[str, Any] | None = None,
    feed: feeds.Feed | None = None,
) -> SaveResult:
    """Write ``state`` (a nested mapping of numpy arrays and JSON values) as a checkpoint.

    The top-level keys ``model``, ``optimizer`` and ``training`` have the meaning the spec
    gives them; any other key is stored as an extension group. ``metadata`` is free-form
    JSON kept in the root (``attributes.ucp.metadata``). A failed save leaves nothing
    that opens as a checkpoint and never touches a committed one unless ``overwrite``.

    ``created`` (an RFC 3339 date-time, default: now) and ``producer`` (an object with
    ``name`` and ``version``, default: this library) are stored in the root as given,
    so that a save of the same state can be byte-for-byte reproducible (the conformance
    cases are generated this way).

    ``feed`` gives the values of the :class:`ucpformat.feed.Deferred` arrays of
    ``state``, which are written in the order given, each as soon as the feed has it
    (:mod:`ucpformat.torch.staging` copies tensors from a GPU this way); the feed is
    started when the writes start and stopped when they end (a save that fails before
    never starts it).
    """
    if hash_algorithm not in (None, *HASH_ALGORITHMS):
        raise InvalidValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS} or None")
    the_plan = plan(
        state,
        compression=compression,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        array_attributes=array_attributes,
    )
    ucp = build_root_ucp(metadata=metadata, values=the_plan.root_values, producer=producer,
                         created=created)
    store = open_store(path, durable=durable)
    # the whole save in one batch: every write, the commit and a failure's clean-up go
    # to the directory it claimed (Store.batch), whatever is put at the path meanwhile
    with _storage_errors(store), store.batch():
        with _storage_errors(store, untouched=True):
            claim = prepare_destination(store, overwrite=overwrite)
        with explain_failure(store, claim), _storage_errors(store):
            objects = write_arrays(
                store, the_plan.arrays, hash_algorithm=hash_algorithm, workers=workers,
                progress=progress, feed=feed,
            )
            commit(
                store,
                arrays=[m for m, _ in the_plan.arrays],
                groups=the_plan.groups,
                objects=objects,
                root_ucp=ucp,
                hash_algorithm=hash_algorithm,
                claim=claim,
            )
    return SaveResult(store.location, len(the_plan.arrays), the_plan.nbytes, len(objects))


@contextlib.contextmanager
def _storage_errors(store: Store, *, untouched: bool = False) -> Iterator[None]:
    """Report a failure of the storage (OSError) as a WriteError naming the checkpoint
    (``untouched``: and saying that nothing was changed)."""
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


def default_workers() -> int:
    return max(2, min(16, 2 * (os.cpu_count() or 1)))


def write_arrays(
    store: Store,
    arrays: Sequence[tuple[ArrayMeta, ArrayValue]],
    *,
    hash_algorithm: str | None,
    workers: int | None = None,
    progress: bool | ProgressCallback = False,
    feed: feeds.Feed | None = None,
) -> list[StoredObject]:
    """Write every stored object of ``arrays`` with a pool of threads.

    The values of :class:`ucpformat.feed.Deferred` arrays come from ``feed``, asked for
    in the order of ``arrays`` and released once their last stored object is written;
    the feed is stopped at the end, whatever happens.
    """
    try:
        return _write_arrays(store, arrays, hash_algorithm=hash_algorithm, workers=workers,
                             progress=progress, feed=feed)
    finally:
        if feed is not None:
            feed.stop()


def _write_arrays(
    store: Store,
    arrays: Sequence[tuple[ArrayMeta, ArrayValue]],
    *,
    hash_algorithm: str | None,
    workers: int | None,
    progress: bool | ProgressCallback,
    feed: feeds.Feed | None,
) -> list[StoredObject]:
    deferred = [data.key for _, data in arrays if isinstance(data, feeds.Deferred)]
    if deferred and feed is None:
        raise InvalidValueError("placeholder arrays (ucpformat.feed.Deferred) need a feed "
                                "that gives their values", path=deferred[0])
    tasks = [
        (meta, coords, data)
        for meta, data in arrays
        for coords in object_coords(meta)
    ]
    remaining = {meta.path: itertools.count(1) for meta, _ in arrays}  # next() is atomic
    counts = {meta.path: meta.object_count for meta, _ in arrays}
    total = sum(meta.nbytes for meta, _ in arrays)
    from ucpformat.progress import byte_progress

    claim = _CLAIMS.get(store)

    def write(meta: ArrayMeta, coords: tuple[int, ...], le: np.ndarray[Any, Any]
              ) -> StoredObject:
        return create_owned(
            store, claim, meta.object_key(coords),
            lambda: write_object(store, meta, coords, le, hash_algorithm=hash_algorithm),
        )

    if feed is not None:
        feed.schedule(deferred)
    with byte_progress(progress, total, "saving") as advance:

        def run(task: tuple[ArrayMeta, tuple[int, ...], ArrayValue]) -> StoredObject:
            meta, coords, value = task
            data = feed.get(value.key) if isinstance(value, feeds.Deferred) and feed \
                else value
            assert isinstance(data, np.ndarray)
            region = data[object_region(meta, coords)]
            le = region.astype(meta.dtype.numpy, copy=False)
            try:
                obj = write(meta, coords, le)
            except UCPError:
                raise
            except OSError as exc:
                raise WriteError(f"writing {meta.object_key(coords)} failed: {exc}",
                                 path=store.location) from exc
            if isinstance(value, feeds.Deferred) and feed is not None and \
                    next(remaining[meta.path]) == counts[meta.path]:
                feed.release(value.key)
            advance(region.nbytes)
            return obj

        pool = ThreadPoolExecutor(workers or default_workers())
        with store.batch():  # the writer threads share what the store opens
            try:
                return list(pool.map(run, tasks))
            except BaseException:
                if feed is not None:
                    feed.stop()  # threads still waiting for a value raise at once
                # the first failure ends the save: the objects not yet started are not
                # written (on a full disk, each would only fail in turn)
                pool.shutdown(wait=True, cancel_futures=True)
                raise
            finally:
                pool.shutdown(wait=True)


# -- adopting arrays written by another writer ----------------------------------------------


def adopt(
    path: str | os.PathLike[str] | Store,
    *,
    attributes: Mapping[str, Mapping[str, Any]] | None = None,
    values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    hash_algorithm: str | None = "sha256",
    durable: bool = True,
) -> SaveResult:
    """Commit, as a checkpoint, the zarr v3 arrays another writer put under ``path``.

    For producers that write the arrays themselves (tensorstore, zarr-python, a C++ or
    JAX exporter, ranks that each write their own shards) and need only the commit.
    Every ``<node>/zarr.json`` under ``path`` is read and checked against format 1.0
    (closed data types and codecs, crc32c, canonical escaped names); every stored object
    of every non-sparse array must exist (a missing one is a MissingChunkError, never
    fill values); groups the writer left implicit are added; then node metadata, the
    manifest (with SHA-256s when ``hash_algorithm`` is set) and, last, the root are
    written by :func:`commit`, exactly as :func:`save` commits.

    ``attributes`` maps node paths (``model/fc.weight``) to attributes merged into that
    node's ``attributes`` (e.g. ``{"ucp": {"role": "parameter"}}``). ``values`` are the
    root's JSON values (what :func:`save` stores for non-array entries of the state, e.g.
    ``{"training": {"step": 10}}``); ``metadata`` is free-form JSON, as for :func:`save`.

    Node ``zarr.json`` files are rewritten in ucpformat's canonical spelling (same
    meaning), so that each equals its entry in the consolidated metadata. A root
    ``zarr.json`` that is a plain zarr group is replaced (its attributes are kept). Refuses
    a directory that already holds a committed checkpoint (UCP-1.0-R053) and files that
    belong to no node (the manifest could not list them, UCP-1.0-R044). The stored
    objects are read once, to size and hash them; they are never modified.
    """
    if hash_algorithm not in (None, *HASH_ALGORITHMS):
        raise InvalidValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS} or None")
    ucp = build_root_ucp(metadata=metadata, values=values)
    extra_attributes = dict(attributes or {})
    store = open_store(path, durable=durable)
    with _storage_errors(store):
        root_attributes: dict[str, Any] = {}
        if store.exists(ZARR_JSON):
            if _holds_checkpoint(store):
                raise CheckpointExistsError(
                    "a committed checkpoint is already here; adopt commits arrays only once",
                    rule="UCP-1.0-R053",
                    path=store.location,
                )
            old_root = parse_group("", loads(store.get(ZARR_JSON) or b"", what=ZARR_JSON),
                                   root=True)
            root_attributes = dict(old_root.attributes)
        keys = sorted(store.list())
        # every node's zarr.json, checked strictly
        arrays: dict[str, ArrayMeta] = {}
        groups: dict[str, GroupMeta] = {}
        for key in keys:
            if not key.endswith(f"/{ZARR_JSON}"):
                continue
            node_path = key[: -len(ZARR_JSON) - 1]
            names.check_path(node_path, where=key)
            doc = loads(store.get(key) or b"", what=key)
            extra = extra_attributes.pop(node_path, None)
            if extra is not None and isinstance(doc, Mapping):
                old = doc.get("attributes", {})
                doc = {**doc, "attributes": {**(old if isinstance(old, Mapping) else {}), **extra}}
            if isinstance(doc, Mapping) and doc.get("node_type") == "array":
                arrays[node_path] = parse_array(node_path, doc)
            else:
                groups[node_path] = parse_group(node_path, doc)
        if extra_attributes:
            raise InvalidValueError(
                f"attributes given for nodes that do not exist: {sorted(extra_attributes)}",
                path=store.location,
            )
        if not arrays:
            raise InvalidValueError("no zarr arrays to adopt", path=store.location)
        # implicit groups, the tree's shape, names
        for node_path in [*arrays, *groups]:
            parent = node_path.rpartition("/")[0]
            while parent:
                if parent in arrays:
                    raise InvalidValueError(
                        f"{node_path!r} lies inside the array {parent!r}", rule="UCP-1.0-R005",
                        path=store.location,
                    )
                groups.setdefault(parent, GroupMeta(parent))
                parent = parent.rpartition("/")[0]
        children: dict[str, list[str]] = {}
        for node_path in [*arrays, *groups]:
            parent, _, leaf = node_path.rpartition("/")
            children.setdefault(parent, []).append(leaf)
            if not parent and leaf.endswith(RESERVED_ROOT_SUFFIX):
                raise InvalidValueError(
                    f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                    rule="UCP-1.0-R004",
                    path=node_path,
                )
        for parent, kids in children.items():
            names.check_case_collisions(kids, parent=parent)
        # every stored object: present, sized, hashed
        owned = {ZARR_JSON, IN_PROGRESS_KEY} | {f"{p}/{ZARR_JSON}" for p in [*arrays, *groups]}
        objects: list[StoredObject] = []
        for meta in arrays.values():
            present = stored_object_coords(meta, keys)
            if not meta.sparse and len(present) != meta.object_count:
                have = set(present)
                # stops at the first gap: at most len(present) + 1 steps, whatever the shape
                first = next(c for c in object_coords(meta) if c not in have)
                raise MissingChunkError(
                    f"{meta.object_count - len(present)} of its {meta.object_count} stored "
                    f"objects are missing (the first is {meta.object_key(first)}); a "
                    "non-sparse array needs every one (mark it attributes.ucp.sparse to have "
                    "absent ones read as fill values)",
                    rule="UCP-1.0-R030",
                    tensor=meta.path,
                )
            for coords in present:
                key = meta.object_key(coords)
                data = store.get(key)
                if data is None:  # removed while we looked
                    raise MissingChunkError(f"stored object {key} vanished", rule="UCP-1.0-R030",
                                            tensor=meta.path)
                digest = hashlib.sha256(data).hexdigest() if hash_algorithm == "sha256" else None
                objects.append(StoredObject(key, len(data), digest))
                owned.add(key)
        foreign = [k for k in keys if k not in owned]
        if foreign:
            raise WriteError(
                f"{len(foreign)} file(s) belong to no node of the checkpoint (first: "
                f"{foreign[0]!r}); remove them or write them as arrays",
                rule="UCP-1.0-R044",
                path=store.location,
            )
        claim = WriteClaim(token := uuid.uuid4().hex, _hold(store, token, take_over=True))
        ordered = sorted(arrays.values(), key=lambda m: m.path)
        try:
            commit(
                store,
                arrays=ordered,
                groups=sorted(groups.values(), key=lambda g: g.path),
                objects=objects,
                root_ucp=ucp,
                root_attributes=root_attributes,
                hash_algorithm=hash_algorithm,
                claim=claim,
                replace=True,
            )
        finally:  # adopt removes nothing: the arrays are another writer's
            _release(store, claim)
    return SaveResult(store.location, len(ordered), sum(m.nbytes for m in ordered), len(objects))

# -- streaming: declare every array first, then give each tensor's data ------------------


class StreamingWriter:
    """Write a checkpoint tensor by tensor, holding only what the caller hands over.

    Every array is declared up front (path, shape, data type, attributes), so the
    metadata is known before any data exists; then each tensor's data is given with
    :meth:`write` (the whole tensor) or :meth:`write_object` (one stored object, for
    tensors too large to hold at once), in any order and from any number of threads.
    :meth:`commit` refuses unless every stored object of every declared array was
    written exactly once. The writer holds its location from its creation to its commit
    (UCP-1.0-R059); leaving the ``with`` block without a commit (or :meth:`abort`) removes
    what it wrote, as a failed :func:`save` does, and releases the location::

        with StreamingWriter("ckpt") as w:
            w.declare("model/fc.weight", (4096, 4096), "bfloat16")
            w.group("optimizer", values={"type": "torch.optim.AdamW"})
            w.write("model/fc.weight", array)
            w.commit(root_values={"step": 10})
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Store,
        *,
        overwrite: bool = False,
        compression: str | Mapping[str, Any] | None = None,
        hash_algorithm: str | None = "sha256",
        chunk_bytes: int = chunking.DEFAULT_CHUNK_BYTES,
        shard_bytes: int = chunking.DEFAULT_SHARD_BYTES,
        durable: bool = True,
    ) -> None:
        if hash_algorithm not in (None, *HASH_ALGORITHMS):
            raise InvalidValueError(f"hash_algorithm must be one of {HASH_ALGORITHMS} or None")
        self.store = open_store(path, durable=durable)
        self.compression = compression
        self.hash_algorithm = hash_algorithm
        self.chunk_bytes = chunk_bytes
        self.shard_bytes = shard_bytes
        self._arrays: dict[str, ArrayMeta] = {}
        self._pending: dict[str, set[tuple[int, ...]]] = {}
        self._groups: dict[str, dict[str, Any]] = {}
        self._objects: list[StoredObject] = []
        self._lock = threading.Lock()
        self._committed = False
        with _storage_errors(self.store, untouched=True):
            self._claim = prepare_destination(self.store, overwrite=overwrite)

    @property
    def location(self) -> str:
        return self.store.location

    @property
    def arrays(self) -> dict[str, ArrayMeta]:
        """The declared arrays, by node path."""
        return dict(self._arrays)

    # -- declaring -------------------------------------------------------------------

    def declare(
        self,
        path: str,
        shape: Sequence[int],
        dtype: str | dtypes.DataType | np.dtype[Any],
        *,
        attributes: Mapping[str, Any] | None = None,
    ) -> ArrayMeta:
        """Declare the array at node ``path`` (escaped names joined by ``/``)."""
        if self._committed:
            raise WriteError("this checkpoint is already committed", path=self.location)
        parts = names.split_path(path, where=path)
        if len(parts) < 1:
            raise InvalidValueError("an array needs a name", path=path)
        if path.split("/")[0].endswith(RESERVED_ROOT_SUFFIX):
            raise InvalidValueError(
                f"top-level names ending in {RESERVED_ROOT_SUFFIX!r} are reserved",
                rule="UCP-1.0-R004", path=path,
            )
        if isinstance(dtype, dtypes.DataType):
            dt = dtype
        elif isinstance(dtype, str):
            dt = dtypes.by_name(dtype, tensor=path)
        else:
            dt = dtypes.from_numpy(np.dtype(dtype), tensor=path)
        dims = tuple(int(s) for s in shape)
        if any(s < 0 for s in dims):
            raise InvalidValueError(f"shape {list(dims)} has a negative size", path=path)
        encoded_attrs = jsonvalues.encode(dict(attributes or {}), where=f"{path} attributes")
        ucp = encoded_attrs.get("ucp", {})
        ch = chunking.choose(
            dims, dt.itemsize, chunk_bytes=self.chunk_bytes, shard_bytes=self.shard_bytes,
            split_dims=chunking.split_dims_of(ucp if isinstance(ucp, Mapping) else {}),
        )
        meta = ArrayMeta(
            path=path,
            shape=dims,
            dtype=dt,
            chunk_shape=ch.chunk_shape,
            shard_shape=ch.shard_shape,
            compression=Compression.parse(self.compression, dt),
            fill_value=zero_bits(dt),
            attributes=encoded_attrs,
        )
        # Write nothing a reader would refuse (a bad attribute, a chunking bug): check first.
        parse_array(path, json.loads(dumps(meta.to_zarr_json())))
        with self._lock:
            if path in self._arrays:
                raise InvalidValueError("this array is already declared", path=path)
            if path in self._groups:
                raise InvalidValueError("a group of this name is already declared", path=path)
            self._arrays[path] = meta
            self._pending[path] = set(object_coords(meta))
        return meta

    def group(
        self,
        path: str,
        *,
        values: Mapping[str, Any] | None = None,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Declare the group at ``path`` with JSON ``values`` and other ``attributes.ucp`` members.

        Parent groups of declared arrays and groups exist without being declared; calling
        this again for the same group merges the members.
        """
        names.check_path(path, where=path)
        if not path:
            raise InvalidValueError("the root's values are given to commit()", path=path)
        ucp: dict[str, Any] = {}
        if attributes:
            ucp.update(jsonvalues.encode(dict(attributes), where=f"{path} attributes"))
        if values:
            ucp["values"] = jsonvalues.encode(dict(values), where=f"{path} values")
        with self._lock:
            if path in self._arrays:
                raise InvalidValueError("an array of this name is already declared", path=path)
            target = self._groups.setdefault(path, {})
            if "values" in ucp and "values" in target:
                merged = dict(target["values"])
                merged.update(ucp.pop("values"))
                target["values"] = merged
            target.update(ucp)

    # -- writing ---------------------------------------------------------------------

    def _meta(self, path: str) -> ArrayMeta:
        meta = self._arrays.get(path)
        if meta is None:
            raise InvalidValueError("no array of this name was declared", path=path)
        return meta

    def _checked(self, meta: ArrayMeta, data: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        arr = np.asarray(data)
        got = dtypes.from_numpy(arr.dtype, tensor=meta.path)
        if got is not meta.dtype:
            raise InvalidValueError(
                f"data of type {got.name} given for an array declared {meta.dtype.name} "
                "(convert explicitly; writers never cast)",
                path=meta.path,
            )
        return arr.astype(meta.dtype.numpy, copy=False)

    def object_regions(self, path: str) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
        """(grid coordinates, region) of every stored object of a declared array."""
        meta = self._meta(path)
        return [(c, object_region(meta, c)) for c in object_coords(meta)]

    def write_object(self, path: str, coords: Sequence[int], data: np.ndarray[Any, Any]) -> int:
        """Write one stored object; ``data`` is that object's region of the tensor."""
        meta = self._meta(path)
        key = tuple(int(c) for c in coords)
        with self._lock:
            pending = self._pending[path]
            if key not in pending:
                raise WriteError(
                    f"stored object {list(key)} was already written or is outside the grid "
                    "(one writer per stored object)",
                    rule="UCP-1.0-R130", tensor=path,
                )
            pending.discard(key)
        try:
            obj = write_object(self.store, meta, key, self._checked(meta, data),
                               hash_algorithm=self.hash_algorithm)
        except BaseException as exc:
            with self._lock:
                self._pending[path].add(key)
            if isinstance(exc, FileExistsError):
                raise ConcurrentWriteError(
                    f"{meta.object_key(key)} was written by another writer during this save",
                    rule="UCP-1.0-R059", tensor=path,
                ) from exc
            raise
        with self._lock:
            self._objects.append(obj)
        return obj.nbytes

    def write(self, path: str, data: np.ndarray[Any, Any]) -> int:
        """Write a whole declared tensor; returns the bytes stored."""
        meta = self._meta(path)
        arr = self._checked(meta, data)
        if tuple(arr.shape) != meta.shape:
            raise InvalidValueError(
                f"data of shape {list(arr.shape)} given for an array declared "
                f"{list(meta.shape)}",
                path=path,
            )
        total = 0
        for coords in object_coords(meta):
            try:
                total += self.write_object(path, coords, arr[object_region(meta, coords)])
            except OSError as exc:
                raise WriteError(f"writing {meta.object_key(coords)} failed: {exc}",
                                 path=self.location) from exc
        return total

    def missing(self) -> dict[str, int]:
        """Declared arrays with stored objects not yet written (path -> count)."""
        with self._lock:
            return {p: len(s) for p, s in self._pending.items() if s}

    # -- commit ------------------------------------------------------------------------

    def commit(
        self,
        *,
        metadata: Mapping[str, Any] | None = None,
        root_values: Mapping[str, Any] | None = None,
        root_attributes: Mapping[str, Any] | None = None,
    ) -> SaveResult:
        """Write the metadata and, last, the root: refused while any object is missing."""
        if self._committed:
            raise WriteError("this checkpoint is already committed", path=self.location)
        missing = self.missing()
        if missing:
            listed = ", ".join(f"{p} ({n})" for p, n in sorted(missing.items())[:5])
            raise WriteError(
                f"{len(missing)} declared arrays are not completely written: {listed}; "
                "nothing was committed",
                rule="UCP-1.0-R031", path=self.location,
            )
        groups: dict[str, GroupMeta] = {}
        for path in [*self._arrays, *self._groups]:
            parts = path.split("/")
            for i in range(1, len(parts)):
                gp = "/".join(parts[:i])
                if gp in self._arrays:
                    raise InvalidValueError(f"{gp!r} is an array and the parent of {path!r}",
                                            path=path)
                groups.setdefault(gp, GroupMeta(gp, {}))
        for gp, ucp in self._groups.items():
            groups[gp] = GroupMeta(gp, {"ucp": dict(ucp)} if ucp else {})
        children: dict[str, list[str]] = {}
        for path in [*self._arrays, *groups]:
            parent, _, leaf = path.rpartition("/")
            children.setdefault(parent, []).append(leaf)
        for parent, leaves in children.items():
            names.check_case_collisions(leaves, parent=parent)
        with explain_failure(self.store, self._claim), _storage_errors(self.store):
            commit(
                self.store,
                arrays=list(self._arrays.values()),
                groups=list(groups.values()),
                objects=self._objects,
                root_ucp=build_root_ucp(metadata=metadata, values=root_values),
                root_attributes=root_attributes,
                hash_algorithm=self.hash_algorithm,
                claim=self._claim,
            )
        self._committed = True
        return SaveResult(
            self.store.location,
            len(self._arrays),
            sum(m.nbytes for m in self._arrays.values()),
            len(self._objects),
        )

    def __enter__(self) -> StreamingWriter:
        return self

    def abort(self) -> str:
        """Give the save up: remove what it wrote and release the location (nothing if it
        is committed). Returns what became of the location, as a sentence."""
        if self._committed:
            return ""
        fate = abandon(self.store, self._claim)
        if self._claim.replaced:
            fate = f"the checkpoint that was here is gone (overwrite=True); {fate}"
        return fate

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if self._committed or self._claim.done:
            return
        fate = self.abort()
        if exc is None or not fate:
            return
        text = f"nothing was committed; {fate}"
        if isinstance(exc, UCPError):
            exc.extend(text)
        else:
            exc.add_note(f"ucpformat: {text}")

