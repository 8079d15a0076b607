"""The bytes of a ZIP archive as the single-file form of a checkpoint uses them (spec §11.5).

Only what that form needs: members stored (method 0), never encrypted, ZIP64 records
where a size, an offset or the member count outgrows the 32- and 16-bit fields, and
each member's data started on a multiple of :data:`ALIGNMENT` by padding in its local
header (an extra field of the kind Android's ``zipalign`` writes, ID 0xD935), so that a
reader can use the bytes of an uncompressed chunk in place. Dates are all 1980-01-01:
an archive's bytes depend only on its members and their order (UCP-1.0-R075,
UCP-1.0-R076).

:func:`member_header` and :func:`directory` write; :func:`read_directory` and
:func:`data_offset` read, checking what they rely on (UCP-1.0-R077).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

from ucpformat.errors import CorruptDataError, UnsafePathError, UnsupportedFeatureError
from ucpformat.store.base import is_safe_key

#: Every member's data starts at a multiple of this many bytes (UCP-1.0-R076).
ALIGNMENT = 64

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
# the fields of a central entry a reader uses: signature, flags, method, CRC-32, sizes,
# the lengths of the name, extra field and comment, where the local header is
_CENTRAL_READ = struct.Struct("<I4xHH4xIIIHHH8xI")
_END = struct.Struct("<IHHHHIIH")  # 22 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_LOCATOR64 = struct.Struct("<IIQI")  # 20 bytes
_EXTRA = struct.Struct("<HH")

LOCAL_SIGNATURE = 0x04034B50
CENTRAL_SIGNATURE = 0x02014B50
END_SIGNATURE = 0x06054B50
END64_SIGNATURE = 0x06064B50
LOCATOR64_SIGNATURE = 0x07064B50
ZIP64_EXTRA = 0x0001
ALIGN_EXTRA = 0xD935

_STORED = 0
_UTF8_NAMES = 0x0800
_ENCRYPTED = 0x0001
_VERSION = 20
_VERSION64 = 45
_MADE_BY_UNIX = 3 << 8
_DATE_1980 = (0 << 9) | (1 << 5) | 1  # 1980-01-01, 00:00
_REGULAR_FILE = 0o100644 << 16
_MAX32 = 0xFFFFFFFF
_MAX16 = 0xFFFF
#: The end record is in the last 22 bytes, or before a comment of at most 65,535.
END_SEARCH_BYTES = _END.size + _MAX16

RULE_FORM = "UCP-1.0-R075"
RULE_READ = "UCP-1.0-R077"


class Member(NamedTuple):
    """One member as the central directory gives it."""

    name: str
    header_offset: int
    size: int
    crc32: int


def member_header(name: str, offset: int, size: int, crc32: int) -> bytes:
    """The local header of a member whose header starts at ``offset``, padded so that
    its data starts at a multiple of :data:`ALIGNMENT`."""
    raw = name.encode()
    zip64 = size >= _MAX32
    extra = _EXTRA.pack(ZIP64_EXTRA, 16) + struct.pack("<QQ", size, size) if zip64 else b""
    pad = -(offset + _LOCAL.size + len(raw) + len(extra)) % ALIGNMENT
    if pad:
        pad += ALIGNMENT if pad < _EXTRA.size + 2 else 0
        extra += _EXTRA.pack(ALIGN_EXTRA, pad - _EXTRA.size) + struct.pack("<H", ALIGNMENT)
        extra += bytes(pad - _EXTRA.size - 2)
    small = _MAX32 if zip64 else size
    head = _LOCAL.pack(LOCAL_SIGNATURE, _VERSION64 if zip64 else _VERSION, _UTF8_NAMES,
                       _STORED, 0, _DATE_1980, crc32, small, small, len(raw), len(extra))
    return head + raw + extra


def directory(members: Sequence[Member], offset: int) -> bytes:
    """The central directory of ``members`` starting at ``offset``, and the end records
    (with ZIP64's where a value outgrows its field)."""
    parts: list[bytes] = []
    for m in members:
        raw = m.name.encode()
        big = [v for v in (m.size, m.size) if v >= _MAX32] + (
            [m.header_offset] if m.header_offset >= _MAX32 else [])
        extra = (_EXTRA.pack(ZIP64_EXTRA, 8 * len(big)) + struct.pack(f"<{len(big)}Q", *big)
                 if big else b"")
        size = _MAX32 if m.size >= _MAX32 else m.size
        where = _MAX32 if m.header_offset >= _MAX32 else m.header_offset
        version = _VERSION64 if big else _VERSION
        parts.append(_CENTRAL.pack(
            CENTRAL_SIGNATURE, _MADE_BY_UNIX | _VERSION64, version, _UTF8_NAMES, _STORED, 0,
            _DATE_1980, m.crc32, size, size, len(raw), len(extra), 0, 0, 0, _REGULAR_FILE,
            where) + raw + extra)
    body = b"".join(parts)
    count, end = len(members), offset + len(body)
    tail = b""
    if count >= _MAX16 or len(body) >= _MAX32 or offset >= _MAX32:
        tail = _END64.pack(END64_SIGNATURE, _END64.size - 12, _MADE_BY_UNIX | _VERSION64,
                           _VERSION64, 0, 0, count, count, len(body), offset)
        tail += _LOCATOR64.pack(LOCATOR64_SIGNATURE, 0, end, 1)
    tail += _END.pack(END_SIGNATURE, 0, 0, min(count, _MAX16), min(count, _MAX16),
                      min(len(body), _MAX32), min(offset, _MAX32), 0)
    return body + tail


def _damage(message: str, where: str, rule: str = RULE_READ) -> CorruptDataError:
    return CorruptDataError(f"not a readable UCP archive: {message}", rule=rule, path=where)


def read_directory(
    read: Callable[[int, int], bytes], file_size: int, *, where: str, limit: int
) -> tuple[dict[str, Member], int]:
    """Every member of the archive (name -> :class:`Member`) and where its central
    directory starts, which no member's data passes. ``read(offset, length)`` reads the
    file. The directory is refused unread beyond ``limit`` bytes (UCP-1.0-R098); a
    member that is compressed, encrypted, named twice or by a name no checkpoint key has,
    or that starts outside the file is refused (UCP-1.0-R075, UCP-1.0-R091)."""
    signature = struct.pack("<I", END_SIGNATURE)
    at = -1
    for tail_len in (min(file_size, _END.size), min(file_size, END_SEARCH_BYTES)):
        tail = read(file_size - tail_len, tail_len)  # first the end record of no comment
        at = tail.rfind(signature)
        while at >= 0 and at + _END.size + struct.unpack_from("<H", tail, at + 20)[0] \
                != tail_len:
            at = tail.rfind(signature, 0, at)
        if at >= 0:
            break
    if at < 0:
        raise _damage("no end of central directory record (the file is not a ZIP archive, "
                      "or is cut short)", where)
    _, disk, cd_disk, _, count, cd_size, cd_offset, _ = _END.unpack_from(tail, at)
    end_at = file_size - tail_len + at
    if disk or cd_disk:
        raise UnsupportedFeatureError("a ZIP archive split over several files",
                                      rule=RULE_FORM, path=where)
    if end_at >= _LOCATOR64.size + _END64.size:
        locator = read(end_at - _LOCATOR64.size, _LOCATOR64.size)
        sig, _, end64_at, _ = _LOCATOR64.unpack(locator)
        if sig == LOCATOR64_SIGNATURE:
            if end64_at + _END64.size > end_at - _LOCATOR64.size:
                raise _damage("its ZIP64 end record lies outside the file", where)
            fields = _END64.unpack(read(end64_at, _END64.size))
            if fields[0] != END64_SIGNATURE:
                raise _damage("no ZIP64 end record where its locator points", where)
            count, cd_size, cd_offset = fields[7], fields[8], fields[9]
            end_at = end64_at
    if cd_offset + cd_size > end_at:
        raise _damage(f"its central directory ({cd_size} bytes at {cd_offset}) lies "
                      "outside the file", where)
    if cd_size > limit:
        raise _damage(f"its central directory of {cd_size:,} bytes is over the limit of "
                      f"{limit:,} for metadata", where, "UCP-1.0-R098")
    cd = read(cd_offset, cd_size)
    members: dict[str, Member] = {}
    pos = 0
    for _ in range(count):
        if pos + _CENTRAL.size > len(cd):
            raise _damage("its central directory ends before its last entry", where)
        sig, flags, method, crc, csize, usize, nlen, elen, clen, header = \
            _CENTRAL_READ.unpack_from(cd, pos)
        if sig != CENTRAL_SIGNATURE:
            raise _damage(f"a central directory entry at {cd_offset + pos} has no signature",
                          where)
        start = pos + _CENTRAL.size
        pos = start + nlen + elen + clen
        name = cd[start:start + nlen].decode("utf-8", "replace")
        if _MAX32 in (csize, usize, header):
            usize, csize, header = _zip64(cd[start + nlen:start + nlen + elen],
                                          (usize, csize, header), name, where)
        if method != _STORED or flags & _ENCRYPTED or csize != usize:
            if name.endswith("/") and usize == 0:
                continue  # a directory entry (stored or not, it holds nothing)
            raise UnsupportedFeatureError(
                f"member {name!r} is compressed or encrypted (ZIP method {method}, flags "
                f"{flags:#06x}): a checkpoint's members are stored as they are; unzip it "
                "and run `ucp pack DIRECTORY FILE.ucpz`, or zip without compression "
                "(`zip -r -0`)",
                rule=RULE_FORM, path=where)
        if not is_safe_key(name):
            if name.endswith("/") and usize == 0:
                continue  # a directory entry
            raise UnsafePathError(f"the archive has a member named {name!r}, which no "
                                  "checkpoint key is", rule="UCP-1.0-R091", path=where)
        if name in members:
            raise _damage(f"two members are named {name!r}", where, RULE_FORM)
        if header + _LOCAL.size + nlen + usize > cd_offset:
            raise _damage(f"member {name!r} runs past the start of the central directory",
                          where)
        members[name] = Member(name, header, usize, crc)
    if pos != cd_size:
        raise _damage(f"its central directory holds {cd_size} bytes but its {count} entries "
                      f"take {pos}", where)
    return members, cd_offset


def _zip64(extra: bytes, values: tuple[int, int, int], name: str, where: str
           ) -> tuple[int, int, int]:
    """The 64-bit values of a central entry's 32-bit fields that say 0xFFFFFFFF."""
    pos = 0
    while pos + _EXTRA.size <= len(extra):
        kind, size = _EXTRA.unpack_from(extra, pos)
        if kind == ZIP64_EXTRA:
            body, out, at = extra[pos + 4:pos + 4 + size], list(values), 0
            for i, v in enumerate(values):
                if v == _MAX32:
                    if at + 8 > len(body):
                        break
                    out[i] = struct.unpack_from("<Q", body, at)[0]
                    at += 8
            else:
                return out[0], out[1], out[2]
            break
        pos += _EXTRA.size + size
    raise _damage(f"member {name!r} has a 32-bit field of 0xFFFFFFFF and no ZIP64 value "
                  "for it", where)


def local_header_bytes(member: Member) -> int:
    """How many bytes of a member's local header :func:`data_offset` reads: the fixed
    part and the member's name."""
    return _LOCAL.size + len(member.name.encode())


def data_offset(header: bytes, member: Member, end: int, *, where: str) -> int:
    """Where the data of ``member`` starts, from its local header (``header``:
    :func:`local_header_bytes` bytes from its offset), checked against the central
    entry (UCP-1.0-R077); its data must end by ``end`` (the next member's header or the
    central directory)."""
    raw = member.name.encode()
    if len(header) < _LOCAL.size + len(raw):
        raise _damage(f"member {member.name!r}'s local header is cut short", where)
    sig, _, flags, method, _, _, _, _, _, nlen, elen = _LOCAL.unpack_from(header)
    if sig != LOCAL_SIGNATURE or method != _STORED or flags & _ENCRYPTED \
            or header[_LOCAL.size:] != raw:
        raise _damage(f"member {member.name!r}'s local header does not match its central "
                      "directory entry", where)
    start = member.header_offset + _LOCAL.size + nlen + elen
    if start + member.size > end:
        raise _damage(f"member {member.name!r} ({member.size} bytes from {start}) runs into "
                      "the next member or the central directory", where)
    return int(start)


__all__ = ["ALIGNMENT", "Member", "data_offset", "directory", "local_header_bytes",
           "member_header", "read_directory"]
