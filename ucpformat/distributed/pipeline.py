"""The distributed save pipeline: one checkpoint written by many ranks, each its own part.

Every distributed save is driven through one interface, :class:`DistributedSave`, by
every framework integration: ``ucpformat.distributed.save_fragments``, torch's
``save_distributed`` and ``AsyncSaver``, the DCP plugin, DeepSpeed, Megatron-core and
JAX. One object per rank and save; its methods are called in this order (each checks
that the one before it ran):

====  ===================================  ==========================  ====================
step  method                               who                         what
====  ===================================  ==========================  ====================
1-2   :meth:`DistributedSave.plan`         every rank (collective)     describe, plan, claim
      or :meth:`~DistributedSave.claim`    the coordinator alone, and  (for a framework
      then :meth:`~DistributedSave.take`   every rank                  that plans itself)
3-5   :meth:`DistributedSave.exchange`     every rank (collective)     exchange, agree,
                                                                       un-commit
6     :meth:`DistributedSave.write`        every rank                  write owned objects
7     :meth:`DistributedSave.commit`       every rank (collective)     gather, check, commit
      or :meth:`~DistributedSave.commit_objects`  the coordinator      (what the framework
                                                                       gathered)
====  ===================================  ==========================  ====================

:meth:`DistributedSave.run` makes every call in order (:func:`save` is it in one call):
the form for integrations that hand over their tensor specs, a :class:`FragmentSource`
(the boxes a rank holds; their values on request: flat ZeRO partitions are boxes of the
tensors they cut through) and their JSON values as group attributes. The DCP plugin
calls :meth:`~DistributedSave.claim` in DCP's ``prepare_global_plan`` (DCP gathers the
ranks' plans and scatters the shares), :meth:`~DistributedSave.take`,
:meth:`~DistributedSave.exchange` and :meth:`~DistributedSave.write` in ``write_data``
and :meth:`~DistributedSave.commit_objects` in ``finish``.

What happens in the steps:

1. describe: :func:`ucpformat.distributed.rank_description.describe`: the specs, boxes
   and group attributes a rank knows (no values), sent to the coordinator alone.
2. plan: the coordinator plans (:func:`plan_shares`,
   :func:`ucpformat.distributed.save_plan.plan_from_descriptions`), then claims the
   location (:func:`mark`: refuse it, or hold it with its in-progress marker; a
   checkpoint being replaced stays committed) and sends each rank its
   :class:`~ucpformat.distributed.save_plan.RankTasks` (:func:`take_share`). No rank but
   the coordinator receives or plans what other ranks hold.
3. exchange (:func:`exchange`): each rank sends owners the cells of their objects that
   it holds, and every rank its status (failed or not).
4. agree (:func:`raise_if_failed`): did any rank fail so far? If so, every rank raises.
5. un-commit (:func:`uncommit`): the coordinator deletes the root of the checkpoint being
   replaced and clears the location.
6. write (:func:`write`): each rank assembles and writes each stored object it owns,
   whole, through the one write loop (:mod:`ucpformat.checkpoint.write_loop`).
7. commit: once every rank has written (what each wrote gathered by the coordinator,
   failures by all), the coordinator checks that every planned object was written, then
   writes the metadata, the manifest and, last, the root ``zarr.json``
   (:func:`ucpformat.checkpoint.commit.commit_checkpoint`).

How does a distributed save fail?

* **No rank waits forever for a peer that failed.** A rank that fails keeps taking part
  in every collective up to the next agreement (steps 1, 3, 5, 6 and 7 are one each): a
  rank whose values could not be read, or that could not even plan, still takes part in
  the exchange, sending its failure report instead of cells, and it raises only once
  every rank knows. Every rank then raises: its own error if it failed with a
  :class:`~ucpformat.errors.UCPError`, else a :class:`~ucpformat.errors.WriteError`
  naming the ranks that failed and why. (A rank that dies rather than raising is the
  communicator's to detect: torch.distributed's timeout or its closed connection.)
* **A failure on any rank means no commit.** Only the coordinator commits, after an
  agreement that every rank wrote what it owns, and only if every planned stored object
  was written (UCP-1.0-R132), and only while it still holds the location (UCP-1.0-R059).
* **One writer per location.** The coordinator's marker is its claim on the location
  (:func:`ucpformat.checkpoint.commit.mark_destination`, UCP-1.0-R059): a second save
  there is refused before it changes anything, every stored object is created (never
  replaces another writer's), and the commit checks the claim's token first.
* **The previous checkpoint survives every failure before the un-commit.** Until step
  5 nothing is written but the in-progress marker, and a checkpoint being replaced
  (``overwrite=True``) stays committed: a failure while describing, planning, reading a
  rank's values for the exchange or exchanging leaves it as it was (the coordinator
  withdraws its marker), loadable. From step 5 on, the location holds either the old
  checkpoint or an uncommitted one (refused), never a mix: a failure while writing
  loses the old checkpoint but commits nothing.
* **A failed save cleans up (UCP-1.0-R049).** Once every rank has stopped (the
  agreement that found the failure), the coordinator abandons the save
  (:func:`ucpformat.checkpoint.commit.abandon`): before the un-commit it withdraws its
  marker, after it removes what every rank wrote, the marker last, and its error says
  what the location holds now. (The DCP plugin's coordinator learns of a failure in
  another rank's ``write_data`` only from DCP's exception: its writer's next ``reset``
  removes the remains, and so does the next save to that location.)
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ucpformat.checkpoint import deferred as feeds
from ucpformat.checkpoint.commit import (
    WriteClaim,
    clear_destination,
    explain_failure,
    mark_destination,
)
from ucpformat.checkpoint.commit import commit_checkpoint as commit_root
from ucpformat.checkpoint.metadata import ArrayMeta, GroupMeta, build_root_ucp
from ucpformat.checkpoint.options import SaveOptions
from ucpformat.checkpoint.write_loop import write_objects
from ucpformat.distributed.comm import (
    Communicator,
    error_report,
    failed_ranks,
    gather_bytes,
    gather_failures,
    scatter_bytes,
)
from ucpformat.distributed.exchange import (
    Exchanged,
    Fragment,
    FragmentList,
    FragmentSource,
    Inbox,
    agree,
    exchange,
    extract,
    raise_if_failed,
    relative_box,
)
from ucpformat.distributed.rank_description import (
    MeshPosition,
    MeshTensor,
    boxes_off_mesh,
    decode_descriptions,
    describe,
    encode_description,
)
from ucpformat.distributed.save_plan import (
    ObjectPlan,
    Plan,
    RankTasks,
    TensorSpec,
    array_meta,
    class_members,
    plan_from_descriptions,
)
from ucpformat.engine.chunking import DEFAULT_SPLITS
from ucpformat.engine.write import StoredObject
from ucpformat.errors import (
    InvalidValueError,
    UCPError,
    WriteError,
    error_document,
    error_from_document,
)
from ucpformat.layout.boxes import Box, as_slices, box_shape, box_size, contains, intersect
from ucpformat.progress import ProgressCallback
from ucpformat.store import Store, check_directory_location, open_store

# -- the destination: marked after step 2, un-committed in step 5 ---------------------------


def mark(store: Store, *, overwrite: bool) -> WriteClaim:
    """End of step 2 (the coordinator): refuse a destination that must not be written
    (before changing anything, UCP-1.0-R049), else hold it with the in-progress marker
    (UCP-1.0-R056, UCP-1.0-R059), which leaves a checkpoint being replaced committed
    (``claim.replacing``: ``overwrite=True`` found one)."""
    return mark_destination(store, overwrite=overwrite)


@contextlib.contextmanager
def given_up(store: Store, claim: WriteClaim | None) -> Iterator[None]:
    """The coordinator (``claim``: its hold on the location; None elsewhere): a failure
    inside abandons the save (:func:`ucpformat.checkpoint.commit.explain_failure`: the marker
    withdrawn before the un-commit, everything the save wrote removed after it) and the
    error says what the location holds now. Only around steps that end in an
    agreement: no rank writes any more when it fails."""
    if claim is None:
        yield
        return
    with explain_failure(store, claim):
        yield


def uncommit(
    comm: Communicator,
    store: Store,
    claim: WriteClaim | None,
    *,
    error: BaseException | None = None,
) -> None:
    """Step 5 (the coordinator, then collective): un-commit the checkpoint being replaced
    (``claim.replacing``, as :func:`mark` said) and clear the location; no rank goes on
    to write before this succeeded. ``claim``: the coordinator's (None on the other
    ranks); ``error``: this rank's failure since the agreement. On a failure anywhere the
    coordinator abandons the save."""
    with given_up(store, claim):
        if claim is not None and error is None:
            try:
                clear_destination(store, claim)
            except BaseException as exc:
                error = exc
        agree(comm, error, "preparing the destination")


def exchange_and_prepare(
    comm: Communicator,
    store: Store,
    tasks: RankTasks | None,
    source: FragmentSource,
    *,
    error: BaseException | None = None,
    claim: WriteClaim | None,
) -> Exchanged:
    """Steps 3 to 5 (collective): everything between the plan and the first write.

    ``error``: this rank's failure so far (it still takes part); ``claim``: the
    coordinator's hold on the destination (:func:`mark`; None on the other ranks, and
    where marking failed). Raises on every rank if any failed, and then the coordinator
    withdraws its marker: a checkpoint it was to replace is as it was. Otherwise the
    destination is ready and the cells are here.
    """
    received = exchange(comm, tasks, source, error)
    with given_up(store, claim):
        raise_if_failed(received.failed, "exchanging boundary cells", received.error)
    uncommit(comm, store, claim, error=received.error)
    return received


# -- step 6: writing ---------------------------------------------------------------------------


def assemble(
    meta: ArrayMeta,
    obj: ObjectPlan,
    local: Sequence[tuple[Box, np.ndarray[Any, Any]]],
    inbox: Mapping[tuple[str, Box], np.ndarray[Any, Any]],
) -> np.ndarray[Any, Any]:
    """The data of one stored object: a view of a local fragment holding it whole, or
    pieced together from local fragments and received cells."""
    if not obj.remote:
        for box, _ in local:
            if contains(box, obj.region):
                return extract(local, meta.path, obj.region)
    out = np.empty(box_shape(obj.region), dtype=meta.dtype.numpy)
    for box, data in local:
        inter = intersect(box, obj.region)
        if inter is not None:
            out[as_slices(relative_box(inter, obj.region))] = \
                data[as_slices(relative_box(inter, box))]
    for _sender, cell in obj.remote:
        out[as_slices(relative_box(cell, obj.region))] = inbox[(meta.path, cell)]
    return out


class _Resolved:
    """Each tensor's fragments, resolved once for the writing threads and dropped when
    its last stored object is written."""

    def __init__(self, source: FragmentSource, objects: Iterable[ObjectPlan]) -> None:
        self._source = source
        # asked once: an isinstance check of a runtime protocol costs tens of microseconds
        self._prefetching = source if isinstance(source, feeds.Prefetching) else None
        self._total = Counter(o.path for o in objects)
        self._done = {p: itertools.count(1) for p in self._total}  # next() is atomic
        self._locks = {p: threading.Lock() for p in self._total}
        self._cache: dict[str, Sequence[tuple[Box, np.ndarray[Any, Any]]]] = {}

    def get(self, path: str) -> Sequence[tuple[Box, np.ndarray[Any, Any]]]:
        local = self._cache.get(path)
        if local is not None:
            return local
        with self._locks[path]:
            local = self._cache.get(path)
            if local is None:
                local = self._cache[path] = self._source.fragments(path)
            return local

    def done(self, path: str) -> None:
        if next(self._done[path]) == self._total[path]:
            self._cache.pop(path, None)
            if self._prefetching is not None:
                self._prefetching.release(path)


def write(
    store: Store,
    tasks: RankTasks,
    source: FragmentSource,
    inbox: Mapping[tuple[str, Box], np.ndarray[Any, Any]],
    *,
    workers: int | None = None,
    hash_algorithm: str | None = None,
    progress: bool | ProgressCallback = False,
    claim: WriteClaim | None = None,
) -> list[StoredObject]:
    """Step 6 (every rank, no collective): assemble and write each stored object this
    rank owns, whole (one writer per shard, UCP-1.0-R130), on ``workers`` threads.

    Every object is created, never replacing one that is there (UCP-1.0-R059): one that
    is there was written by another writer during this save, which fails, unless this
    is the coordinator (``claim``) still holding the location (then that writer was
    displaced and its object is replaced, :func:`ucpformat.checkpoint.commit.create_owned`).

    A prefetching source (:class:`ucpformat.checkpoint.deferred.Prefetching`) learns the order
    in which tensors are needed first, and is stopped at the end, whatever happens.

    Every rank makes its objects durable before it returns, but the coordinator
    (``claim``): its commit (:func:`ucpformat.checkpoint.commit.commit_checkpoint`, through the
    same ``store``) flushes them with the metadata, before the root is written."""
    try:
        return _write(store, tasks, source, inbox, workers=workers,
                      hash_algorithm=hash_algorithm, progress=progress, claim=claim)
    finally:
        feeds.stop(source)


def _write(
    store: Store,
    tasks: RankTasks,
    source: FragmentSource,
    inbox: Mapping[tuple[str, Box], np.ndarray[Any, Any]],
    *,
    workers: int | None,
    hash_algorithm: str | None,
    progress: bool | ProgressCallback,
    claim: WriteClaim | None,
) -> list[StoredObject]:
    feeds.schedule(source, list(dict.fromkeys(o.path for o in tasks.objects)))
    resolved = _Resolved(source, tasks.objects)
    # every rank but the coordinator makes its objects durable before it reports them
    # written, through the descriptor its writes used; the coordinator's are made durable
    # by the commit's flush, which covers every file this store wrote, before the root
    # (one flush of them, not two)
    return write_objects(
        store, tasks.objects,
        target=lambda obj: (tasks.arrays[obj.path], obj.coords),
        values=lambda obj: assemble(tasks.arrays[obj.path], obj, resolved.get(obj.path), inbox),
        written=lambda obj: resolved.done(obj.path),
        stop=lambda: feeds.stop(source),
        claim=claim, hash_algorithm=hash_algorithm, workers=workers, progress=progress,
        total_bytes=sum(box_size(o.region) * tasks.arrays[o.path].dtype.itemsize
                        for o in tasks.objects),
        label=f"rank {tasks.rank} saving", flush=claim is None, name_every_os_error=True,
    )


# -- step 7: the commit ----------------------------------------------------------------------


def check_written(expected: Iterable[str], written: Iterable[str], location: str) -> None:
    """Refuse to commit unless every planned stored object was written (UCP-1.0-R132)."""
    missing = sorted(set(expected) - set(written))
    if missing:
        raise WriteError(
            f"{len(missing)} planned shards were not written (first: {missing[0]!r}); "
            "nothing was committed", rule="UCP-1.0-R132", path=location,
        )


def commit_collective(
    comm: Communicator,
    store: Store,
    plan: Plan | None,
    written: Iterable[StoredObject],
    *,
    claim: WriteClaim | None,
    root_ucp: Mapping[str, Any],
    hash_algorithm: str | None,
) -> None:
    """Step 7 (the coordinator, then collective): with what every rank ``written`` (read
    by the coordinator only), the coordinator (``claim``: its hold on the location; None
    on the other ranks) checks it against the plan and commits if it still holds the
    location (UCP-1.0-R059); every rank learns the outcome. On a failure the coordinator
    abandons the save. ``plan``: the coordinator's (None elsewhere)."""
    error: BaseException | None = None
    if claim is not None:
        try:
            if plan is None:
                raise WriteError("the coordinator has no plan to commit")
            objects = list(written)
            # every rank writes only the objects the plan gave it: as many distinct keys
            # as planned objects means every one (else the keys say which are missing)
            if len({o.key for o in objects}) != plan.object_count():
                check_written(plan.object_keys(), (o.key for o in objects), store.location)
            commit_root(
                store,
                arrays=[tp.meta for tp in plan.tensors.values()],
                groups=list(plan.groups.values()),
                objects=objects,
                root_ucp=root_ucp,
                hash_algorithm=hash_algorithm,
                claim=claim,
            )
        except BaseException as exc:
            error = exc
    with given_up(store, claim):
        agree(comm, error, "committing")


# -- step 2 on the coordinator: plan, mark, hand each rank its share -------------------------

_NOTHING: Mapping[str, Any] = {"specs": [], "boxes": [], "groups": {}}


def plan_shares(
    blobs: Sequence[bytes],
    options: SaveOptions,
    store: Store,
    *,
    overwrite: bool,
    own: BaseException | None = None,
) -> tuple[Plan | None, dict[int, bytes], WriteClaim | None, BaseException | None]:
    """Step 2 on the coordinator, from every rank's
    :func:`~ucpformat.distributed.rank_description.encode_description`: the plan, what each rank
    receives (its :class:`RankTasks`; or the ranks that failed to describe; or the
    plan's error), its hold on the location (:func:`mark`; None if it did not mark it),
    and its own failure (``own``: before this step)."""
    world = len(blobs)
    plan: Plan | None = None
    error = own
    try:
        descriptions = decode_descriptions(blobs)
    except BaseException as exc:
        return None, _to_all(world, {"error": _error_doc(exc)}), None, error or exc
    failed = failed_ranks([d.error for d in descriptions])
    if failed:
        return None, _to_all(world, {"failed": failed}), None, error
    try:
        plan = plan_from_descriptions(descriptions, options)
        # each array's zarr.json encoded once, spliced into every share that names it
        docs = {path: json.dumps(tp.meta.to_zarr_json(), separators=(",", ":")).encode()
                for path, tp in plan.tensors.items()}
        tail = b',"tensors":%d}' % len(plan.tensors)
        shares = {r: b'{"tasks":' + t.to_json_bytes(docs) + tail
                  for r, t in enumerate(plan.all_tasks()) if r != 0}
    except BaseException as exc:
        return None, _to_all(world, {"error": _error_doc(exc)}), None, error or exc
    claim: WriteClaim | None = None
    if error is None:
        try:
            claim = mark(store, overwrite=overwrite)
        except BaseException as exc:
            error = exc
    shares[0] = b"{}"
    return plan, shares, claim, error


def _error_doc(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, UCPError):
        return error_document(exc)
    return error_document(WriteError(f"planning failed on the coordinator: {error_report(exc)}"))


def _to_all(world: int, doc: Mapping[str, Any]) -> dict[int, bytes]:
    body = json.dumps(doc, separators=(",", ":")).encode()
    return dict.fromkeys(range(world), body)


@dataclass
class Share:
    """What a rank takes from step 2 (:func:`take_share`)."""

    tasks: RankTasks | None  # None: the plan failed (``error`` says why)
    tensors: int  # arrays in the checkpoint
    error: BaseException | None  # this rank's failure, carried to the exchange


def take_share(
    share: bytes,
    plan: Plan | None,
    rank: int,
    error: BaseException | None,
    description: Mapping[str, Any] | None = None,
) -> Share:
    """What a rank does with what the coordinator sent it (:func:`plan_shares`): its
    tasks, or the error it carries to the exchange (the plan's, which every rank raises
    alike); raises at once, on every rank, if a rank failed to describe itself.
    ``plan``: the coordinator's own (None on the other ranks); ``description``: what
    this rank described (:func:`~ucpformat.distributed.rank_description.describe`), from
    which it expands its share of the classes of tensors on meshes."""
    doc = json.loads(share or b"{}")
    raise_if_failed([(int(r), str(e)) for r, e in doc.get("failed", ())],
                    "describing fragments", error)
    if "error" in doc:
        return Share(None, 0, error or error_from_document(doc["error"]))
    if plan is not None:  # the coordinator's own share
        return Share(plan.tasks(rank), len(plan.tensors), error)
    if "tasks" not in doc:
        return Share(None, 0, error or WriteError("the coordinator sent no tasks to this rank"))
    try:
        tasks = RankTasks.from_json(doc["tasks"])
        if tasks.classes:
            sharded = (description or {}).get("sharded", ())
            on_mesh = {str(entry[0]) for entry in sharded}
            spec_of = {s["path"]: TensorSpec.from_json(s)
                       for s in (description or {}).get("specs", ()) if s["path"] in on_mesh}
            tasks.expand(class_members(spec_of, sharded),
                         lambda path, ct: array_meta(spec_of[path], ct.grid, ct.compression))
    except BaseException as exc:  # carried to the exchange: no rank waits for this one
        return Share(None, 0, error or exc)
    return Share(tasks, int(doc["tensors"]), error)


# -- all steps ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedSaveResult:
    location: str
    tensors: int
    objects_written_here: int
    bytes_written_here: int
    bytes_received_here: int


class DistributedSave:
    """One rank's part in one distributed save: the pipeline's public interface.

    Create one per rank and save, then call, in this order (the module docstring's table
    says who calls what; a call out of order raises :class:`~ucpformat.errors.WriteError`
    before doing anything):

    1. :meth:`plan` (collective), or, where the framework plans and scatters itself (DCP),
       :meth:`claim` on the coordinator and :meth:`take` on every rank;
    2. :meth:`exchange` (collective);
    3. :meth:`write`;
    4. :meth:`commit` (collective), or :meth:`commit_objects` on the coordinator with what
       the framework gathered.

    :meth:`run` makes every call. A failure on any rank raises on every rank, commits
    nothing and keeps or cleans the location as the module docstring states. Rank 0 of
    ``comm`` is the coordinator: it holds the location from its claim to its commit.
    """

    def __init__(self, path: str | os.PathLike[str] | Store, comm: Communicator,
                 options: SaveOptions | None = None, *, coordinator: bool | None = None
                 ) -> None:
        self.options = options or SaveOptions()
        if self.options.chunk_splits != DEFAULT_SPLITS:
            raise InvalidValueError(
                f"chunk_splits={self.options.chunk_splits}: a distributed save cuts inner "
                "chunks on the fragments' grid; chunk_splits applies to single-process saves",
                path=os.fspath(path) if not isinstance(path, Store) else path.location)
        check_directory_location(path)
        self.comm = comm
        self.store = open_store(path, durable=self.options.durable)
        #: The rank that claims and commits: rank 0 of ``comm`` unless the framework names
        #: its own (DCP's coordinator rank); :meth:`plan` needs it to be rank 0.
        self.coordinator = comm.rank == 0 if coordinator is None else coordinator
        self._step = "created"
        self._plan: Plan | None = None
        self._claim: WriteClaim | None = None
        self._tasks: RankTasks | None = None
        self._error: BaseException | None = None
        self._tensors = 0
        self._root_ucp: dict[str, Any] = {}
        self._received: Exchanged | None = None
        self._objects: list[StoredObject] = []

    @property
    def tasks(self) -> RankTasks:
        """This rank's share of the plan (after the exchange agreed that every rank has one)."""
        if self._tasks is None:
            raise WriteError("this rank has no share of the plan yet", path=self.store.location)
        return self._tasks

    @property
    def location_claim(self) -> WriteClaim | None:
        """The coordinator's hold on the location (None on the other ranks)."""
        return self._claim

    def _advance(self, expected: tuple[str, ...], to: str) -> None:
        if self._step not in expected:
            raise WriteError(
                f"DistributedSave: {to} was called after {self._step}; the order is plan (or "
                "claim and take), exchange, write, commit", path=self.store.location)
        self._step = to

    # -- steps 1-2 ---------------------------------------------------------------------------

    def plan(
        self,
        specs: Sequence[TensorSpec],
        source: FragmentSource,
        *,
        group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
        meshes: Sequence[MeshPosition] = (),
        on_mesh: Sequence[MeshTensor] = (),
        root_values: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> None:
        """Steps 1 and 2 (collective): describe what this rank holds, let the coordinator
        plan and claim the location, take this rank's share. A failure is carried to the
        exchange's agreement (no rank waits for a peer that failed); a rank that failed to
        describe itself makes every rank raise here."""
        self._advance(("created",), "plan")
        if self.coordinator != (self.comm.rank == 0):
            raise WriteError("plan() gathers on rank 0: its coordinator is rank 0",
                             path=self.store.location)
        error: BaseException | None = None
        description: dict[str, Any] = {}
        try:
            description = describe(specs, boxes_off_mesh(source.boxes(), specs, meshes, on_mesh),
                                   group_attributes, meshes=meshes, on_mesh=on_mesh)
            if self.coordinator:
                self._root_ucp = build_root_ucp(
                    metadata=metadata, values=root_values,
                    saved_by={"world_size": self.comm.world_size})
        except BaseException as exc:  # reported collectively below
            error = exc
        blobs = gather_bytes(self.comm, encode_description(
            {**(description or _NOTHING), "error": error_report(error)}))
        shares: dict[int, bytes] | None = None
        if self.coordinator:
            self._plan, shares, self._claim, error = plan_shares(
                blobs or [], self.options, self.store, overwrite=self.options.overwrite,
                own=error)
        mine = take_share(scatter_bytes(self.comm, shares), self._plan, self.comm.rank, error,
                          description)
        self._tasks, self._error, self._tensors = mine.tasks, mine.error, mine.tensors

    def claim(self, plan: Plan) -> list[RankTasks]:
        """Step 2 on the coordinator, for a framework that gathered the ranks' holdings and
        planned itself (:func:`ucpformat.distributed.save_plan.make_plan`): claim the
        location (refused before anything changes) and return every rank's share, for
        the framework to hand out (each rank then calls :meth:`take`)."""
        if not self.coordinator:
            raise WriteError("only the coordinator (rank 0) claims the location",
                             path=self.store.location)
        self._advance(("created",), "claim")
        self._plan = plan
        self._claim = mark(self.store, overwrite=self.options.overwrite)
        return plan.all_tasks()

    def take(self, tasks: RankTasks | None, error: BaseException | None = None, *,
             tensors: int = 0) -> None:
        """Step 2 on every rank, after :meth:`claim`: this rank's share (None, with
        ``error``, if it could not get it: the failure is carried to the exchange)."""
        self._advance(("created", "claim"), "take")
        self._tasks, self._error, self._tensors = tasks, error, tensors

    # -- steps 3-6 ---------------------------------------------------------------------------

    def exchange(self, source: FragmentSource, error: BaseException | None = None) -> None:
        """Steps 3 to 5 (collective): move the boundary cells, agree that no rank failed
        (else every rank raises and the coordinator withdraws its claim: a checkpoint it
        was to replace is as it was), un-commit what is being replaced. ``error``: this
        rank's failure since its share (it still takes part)."""
        self._advance(("plan", "take"), "exchange")
        self._received = exchange_and_prepare(
            self.comm, self.store, self._tasks, source, error=self._error or error,
            claim=self._claim)

    def write(self, source: FragmentSource) -> list[StoredObject]:
        """Step 6 (every rank, no collective): write each stored object this rank owns.
        A failure here is carried to :meth:`commit`'s agreement by :meth:`run`; a
        framework that calls this itself gathers failures its own way (DCP does)."""
        self._advance(("exchange",), "write")
        assert self._received is not None
        self._objects = write(
            self.store, self.tasks, source, self._received.inbox,
            workers=self.options.workers, hash_algorithm=self.options.hash_algorithm,
            progress=self.options.progress if self.coordinator else False, claim=self._claim)
        return self._objects

    # -- step 7 ------------------------------------------------------------------------------

    def commit(self, error: BaseException | None = None) -> DistributedSaveResult:
        """Step 7 (collective): what each rank wrote goes to the coordinator, whether it
        failed to every rank; the coordinator checks every planned object was written and
        commits; every rank learns the outcome. ``error``: this rank's failure in
        :meth:`write` (it still takes part)."""
        self._advance(("write", "exchange"), "commit")
        objects = self._objects if error is None else []
        written = gather_bytes(self.comm, json.dumps(
            [[o.key, o.nbytes, o.sha256] for o in objects], separators=(",", ":")).encode())
        failed = gather_failures(self.comm, error)
        with given_up(self.store, self._claim):  # every rank has stopped writing
            raise_if_failed(failed, "writing shards", error)
        every = (StoredObject(k, n, h) for raw in written or () for k, n, h in json.loads(raw))
        commit_collective(self.comm, self.store, self._plan, every, claim=self._claim,
               root_ucp=self._root_ucp, hash_algorithm=self.options.hash_algorithm)
        assert self._received is not None
        return DistributedSaveResult(
            self.store.location, self._tensors, len(objects), sum(o.nbytes for o in objects),
            self._received.received_bytes)

    def commit_objects(
        self,
        objects: Sequence[StoredObject],
        *,
        arrays: Sequence[ArrayMeta],
        groups: Sequence[GroupMeta],
        root_ucp: Mapping[str, Any],
        expected: Iterable[str] | None = None,
    ) -> None:
        """Step 7 on the coordinator alone, for a framework that gathered what every rank
        wrote itself (DCP's ``finish``): check that every planned object (``expected``:
        default, the plan's; empty: the framework checked) was written, then commit ``arrays``
        and ``groups`` (the plan's, with what the framework added). A failure abandons the
        save."""
        if self._claim is None:
            raise WriteError("only the coordinator that claimed the location commits",
                             path=self.store.location)
        self._advance(("write",), "commit")
        claim = self._claim
        with explain_failure(self.store, claim):
            planned = expected if expected is not None else (
                self._plan.object_keys() if self._plan is not None else ())
            check_written(planned, (o.key for o in objects), self.store.location)
            commit_root(self.store, arrays=arrays, groups=groups, objects=objects,
                        root_ucp=root_ucp, hash_algorithm=self.options.hash_algorithm,
                        claim=claim)

    # -- all steps -----------------------------------------------------------------------------

    def run(
        self,
        specs: Sequence[TensorSpec],
        source: FragmentSource,
        *,
        group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
        meshes: Sequence[MeshPosition] = (),
        on_mesh: Sequence[MeshTensor] = (),
        root_values: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> DistributedSaveResult:
        """Every step, collectively, as one batch of the location (every write, the commit
        and a failure's clean-up go to the directory the coordinator claimed,
        :meth:`ucpformat.store.Store.batch`, whatever is put at the path meanwhile)."""
        with self.store.batch():
            self.plan(specs, source, group_attributes=group_attributes, meshes=meshes,
                      on_mesh=on_mesh, root_values=root_values, metadata=metadata)
            self.exchange(source)
            error: BaseException | None = None
            try:
                self.write(source)
            except BaseException as exc:
                error = exc
            return self.commit(error)


def save(
    path: str | os.PathLike[str] | Store,
    comm: Communicator,
    *,
    specs: Sequence[TensorSpec],
    source: FragmentSource,
    group_attributes: Mapping[str, Mapping[str, Any]] | None = None,
    meshes: Sequence[MeshPosition] = (),
    on_mesh: Sequence[MeshTensor] = (),
    root_values: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    options: SaveOptions | None = None,
    hash_algorithm: str | None = None,
    overwrite: bool = False,
    workers: int | None = None,
    durable: bool = True,
    progress: bool = False,
) -> DistributedSaveResult:
    """:meth:`DistributedSave.run` in one call: every rank passes the specs of the tensors
    it knows and what it holds. Rank 0 is the coordinator; ``root_values`` and
    ``metadata`` are its. Tensors laid out on device meshes (``on_mesh``; this rank's
    place in each mesh: ``meshes``) are described by their layout, not their fragments'
    boxes: the coordinator plans each class of alike tensors once. Raises on every rank
    if any rank fails; then nothing is committed. The settings are ``options`` or the
    keywords (``hash_algorithm`` to ``progress``), not both
    (:meth:`~ucpformat.checkpoint.options.SaveOptions.merged`)."""
    saving = SaveOptions.merged(options, hash_algorithm=hash_algorithm, overwrite=overwrite,
                                workers=workers, durable=durable, progress=progress)
    return DistributedSave(path, comm, saving).run(
        specs, source, group_attributes=group_attributes, meshes=meshes, on_mesh=on_mesh,
        root_values=root_values, metadata=metadata)



def __getattr__(name: str) -> Any:
    if name == "commit":  # the collective commit step's name before 0.2
        import warnings

        warnings.warn("ucpformat.distributed.pipeline.commit is now commit_collective (the old "
                      "name goes away in the next release)", DeprecationWarning, stacklevel=2)
        return commit_collective
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DistributedSave",
    "DistributedSaveResult",
    "Exchanged",
    "Fragment",
    "FragmentList",
    "FragmentSource",
    "Inbox",
    "Share",
    "agree",
    "assemble",
    "check_written",
    "commit_collective",
    "exchange",
    "exchange_and_prepare",
    "extract",
    "given_up",
    "mark",
    "plan_shares",
    "raise_if_failed",
    "save",
    "take_share",
    "uncommit",
    "write",
]
