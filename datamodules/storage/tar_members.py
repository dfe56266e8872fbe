"""The members of a tar, header by header: plain ustar headers parsed directly (a few microseconds
each), any other (pax, GNU long names, links, a bad checksum) by the standard library's ``tarfile``.

Samples follow webdataset's convention: a member's key is its name up to the first dot of its last
path component, its field the rest, lowercased (``a/b.c/x.seg.jpg``: key ``a/b.c/x``, field
``seg.jpg``); consecutive members with one key form a sample; directories, links and webdataset's
``__*__`` metadata members are not samples' members, nor is a name with no dot.
"""

from __future__ import annotations

import hashlib
import re
import tarfile
from collections.abc import Iterable, Iterator
from typing import NamedTuple

BLOCK = tarfile.BLOCKSIZE
_KEY_AND_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_ZEROS = bytes(BLOCK)
_MAGICS = (b"ustar\x0000", b"ustar  \x00")  # POSIX, GNU
_PLAIN_TYPES = {tarfile.REGTYPE: True, tarfile.AREGTYPE: True, tarfile.DIRTYPE: False}  # type -> a regular file


def key_and_field(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a member name by webdataset's rule; ``None`` for a name with no dot."""
    match = _KEY_AND_FIELD.match(name)
    return None if match is None else (match.group(1), match.group(2).lower())


class Member(NamedTuple):
    """A regular member: where its first header block starts (a pax or long-name block, if it has
    one), where its data starts and its size, its name, and its own 512-byte header (the block just
    before its data)."""

    offset: int
    data: int
    size: int
    name: str
    header: bytes


class TarWalk:
    """The regular members of the tar in ``fileobj`` (``size`` bytes; a file object that seeks and
    reads), in order, webdataset's metadata members left out. The walk stops at the end-of-archive
    block, at a block that is no header (a truncated or corrupt tar) and at a member whose data runs
    past ``size``; ``stopped_at`` is then where. A file whose first block is no header is refused,
    naming ``name``."""

    def __init__(self, fileobj: object, size: int, name: str) -> None:
        self.fileobj, self.size, self.name = fileobj, size, name
        self.stopped_at = 0

    def __iter__(self) -> Iterator[Member]:
        position = 0
        while True:
            block = self._read(position, BLOCK)
            if block == _ZEROS or (position and len(block) < BLOCK):  # the archive's end, or cut short there
                break
            plain = _plain_header(block)
            if plain is not None:
                name, regular, size = plain
                offset, data, header = position, position + BLOCK, block
                following = data + (-(-size // BLOCK) * BLOCK if regular else 0)
            else:
                found = self._through_tarfile(position)
                if found is None:
                    break
                info, following = found
                name, regular, size = info.name, info.isreg(), info.size
                offset, data = info.offset, info.offset_data
                header = self._read(data - BLOCK, BLOCK) if regular else b""
            if data + size > self.size:  # its data runs past the end
                position = offset
                break
            if regular and not _META.match(name):
                yield Member(offset, data, size, name, header)
            position = following
        self.stopped_at = position

    def _read(self, position: int, length: int) -> bytes:
        self.fileobj.seek(position)  # type: ignore[attr-defined]
        return self.fileobj.read(length)  # type: ignore[attr-defined]

    def _through_tarfile(self, position: int) -> tuple[tarfile.TarInfo, int] | None:
        """The member whose header blocks start at ``position`` and where the next one starts, read by
        ``tarfile``; ``None`` if no header starts there."""
        self.fileobj.seek(position)  # type: ignore[attr-defined]
        try:
            tar = tarfile.open(fileobj=self.fileobj, mode="r:")  # type: ignore[call-overload]
        except tarfile.ReadError as err:  # raised only where the tar would start
            if position == 0:
                raise ValueError(f"{self.name} is not a tar file ({err})") from None
            return None
        return None if tar.firstmember is None else (tar.firstmember, tar.offset)


def _plain_header(block: bytes) -> tuple[str, bool, int] | None:
    """``(name, regular, size)`` of a ustar header of a file or a folder, read as ``tarfile`` reads it;
    ``None`` for any other block (another kind of header, a bad checksum, not a header)."""
    if len(block) != BLOCK or block[257:265] not in _MAGICS or block[124] & 0x80:  # 0x80: a base-256 size
        return None
    kind = block[156:157]
    if kind not in _PLAIN_TYPES:
        return None
    try:
        size, checksum = _octal(block[124:136]), _octal(block[148:156])
    except ValueError:
        return None
    if checksum != sum(block) - sum(block[148:156]) + 8 * ord(" "):
        return None
    name = _text(block[:100])
    regular = _PLAIN_TYPES[kind] and not (kind == tarfile.AREGTYPE and name.endswith("/"))  # a V7 folder
    if block[345]:  # a ustar name's first part
        name = f"{_text(block[345:500])}/{name}"
    return name, regular, size


def _octal(field: bytes) -> int:
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", errors="surrogateescape")


def samples_of(members: Iterable[Member]) -> Iterator[tuple[str, list[Member]]]:
    """``(key, members)`` of each sample, in order: consecutive members sharing a key (a member with no
    key in between does not end the sample)."""
    key, found = None, []
    for member in members:
        parts = key_and_field(member.name)
        if parts is None:
            continue
        if parts[0] != key and found:
            yield key, found  # type: ignore[misc]
            found = []
        key = parts[0]
        found.append(member)
    if found:
        yield key, found  # type: ignore[misc]


def headers_digest(members: Iterable[Member]) -> int:
    """An 8-byte digest (a signed int64) of the members' own 512-byte headers, in order: their names,
    sizes, modes, times and checksums; a header rewritten or shifted by any of these reads as another
    digest."""
    digest = hashlib.blake2b(digest_size=8)
    for member in members:
        digest.update(member.header)
    return int.from_bytes(digest.digest(), "little", signed=True)


def is_tar_end(fileobj: object, position: int) -> bool:
    """Whether an end-of-archive block lies at ``position`` (else the tar was cut or corrupted there)."""
    fileobj.seek(position)  # type: ignore[attr-defined]
    return fileobj.read(BLOCK) == _ZEROS  # type: ignore[attr-defined]
