"""The one error hierarchy of ucpformat.

Every error carries the spec requirement it enforces (``rule``, e.g. ``UCP-1.0-R020``)
when there is one, and the checkpoint, tensor or file it concerns, so that a message
alone tells the user what is wrong and where.
"""

from __future__ import annotations


class UCPError(Exception):
    """Base class of every error raised by ucpformat."""

    def __init__(
        self,
        message: str,
        *,
        rule: str | None = None,
        path: str | None = None,
        tensor: str | None = None,
    ) -> None:
        self.message = message
        self.rule = rule
        self.path = path
        self.tensor = tensor
        super().__init__(self._render())

    def extend(self, text: str) -> None:
        """Add a sentence to the message: what a failure left behind, say."""
        self.message = f"{self.message}; {text}"
        self.args = (self._render(),)

    def _render(self) -> str:
        where = self.tensor or self.path
        parts = []
        if self.rule:
            parts.append(f"[{self.rule}]")
        if where:
            parts.append(f"{where}:")
        parts.append(self.message)
        return " ".join(parts)


def restated(error: UCPError, message: str) -> UCPError:
    """A new error of ``error``'s class, rule, path and tensor, with another message (to
    raise ``from error`` where a caller has something to add)."""
    return type(error)(message, rule=error.rule, path=error.path, tensor=error.tensor)


# -- reading and validating ---------------------------------------------------------


class FormatError(UCPError):
    """A checkpoint (or part of one) does not follow the spec."""


class IncompleteCheckpointError(FormatError):
    """The checkpoint was never committed (no root metadata), or its commit is damaged."""


class VersionError(FormatError):
    """The format version is missing, malformed, or of a major version this reader refuses."""


class UnsupportedFeatureError(FormatError):
    """The checkpoint uses a data type, codec or feature outside the spec's closed lists."""


class UnsafePathError(FormatError):
    """A name or path would escape the checkpoint, or names something that is not allowed."""


class MissingChunkError(FormatError):
    """A chunk or shard that must exist is absent: never read as fill values."""


class CorruptDataError(FormatError):
    """Stored bytes are damaged: truncated, undecodable, or of the wrong size."""


class ChecksumError(CorruptDataError):
    """A CRC32C or SHA-256 check failed."""


class CheckpointNotFoundError(FormatError, FileNotFoundError):
    """Nothing that could be a checkpoint exists at the given location."""


class ManagerRecordError(UCPError):
    """A checkpoint manager's record of the checkpoints it wrote cannot be trusted: it
    changed since the manager wrote it, another user owns it, it is malformed, or its HMAC
    does not verify (``ucpformat.manager``). Names the record's file."""


class StorageError(UCPError, OSError):
    """The storage refused a read: permission denied, a file where a directory should be,
    a name too long for the file system, an I/O error (UCP-1.0-R099). Names the file and
    the operating system's reason; also an OSError, for callers that catch those."""


class SelectionError(UCPError, IndexError):
    """A slice or index does not fit the tensor it selects from."""


class ResourceLimitError(UCPError):
    """Honouring the request would allocate beyond a configured or physical limit."""


class MissingDependencyError(UCPError, ImportError):
    """An optional dependency that the request needs is not installed; names the extra."""


class TensorNotFoundError(UCPError, KeyError):
    """No tensor, group or value of that name exists in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self._render()


# -- writing ------------------------------------------------------------------------


class WriteError(UCPError):
    """A save could not be carried out; the message says what it left behind (with
    ``overwrite=True``, the checkpoint it replaced may be gone)."""


class InvalidNameError(WriteError, ValueError):
    """A tensor or group name breaks the naming rules."""


class UnsupportedDtypeError(WriteError, TypeError):
    """A tensor's data type is not in the spec's closed list."""


class CheckpointExistsError(WriteError, FileExistsError):
    """The destination already holds a committed checkpoint or foreign files."""


class ConcurrentWriteError(WriteError):
    """Another writer holds the location, or took it over during this save."""


class InvalidValueError(WriteError, ValueError):
    """A value in the state cannot be stored (not an array, not JSON-able, bad key)."""


# -- layout -------------------------------------------------------------------------


class LayoutError(UCPError, ValueError):
    """Layout semantics are inconsistent, or a target layout cannot be applied."""


# -- loading into a framework's objects ---------------------------------------------


class LoadError(UCPError):
    """A checkpoint does not fit the objects it is loaded into (model, optimizer, ...)."""


class KeyMismatchError(LoadError, KeyError):
    """Tensors or parameters are missing from the checkpoint, or it holds unexpected ones."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self._render()


class ShapeMismatchError(LoadError, ValueError):
    """A stored tensor's shape differs from that of the tensor it is loaded into."""


# -- errors that travel between ranks -------------------------------------------------


def error_document(error: UCPError) -> dict[str, str | None]:
    """A UCPError as JSON, so that the ranks a coordinator planned for raise the same
    error it did (:func:`error_from_document`)."""
    return {"type": type(error).__name__, "message": error.message, "rule": error.rule,
            "path": error.path, "tensor": error.tensor}


def error_from_document(doc: dict[str, str | None]) -> UCPError:
    """The error of an :func:`error_document`: the same class if it is one of this
    module's, else a :class:`WriteError` with the same message."""
    cls = globals().get(str(doc.get("type")))
    if not (isinstance(cls, type) and issubclass(cls, UCPError)):
        cls = WriteError
    return cls(str(doc.get("message")), rule=doc.get("rule"), path=doc.get("path"),
               tensor=doc.get("tensor"))
