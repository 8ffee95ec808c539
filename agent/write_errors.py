"""What a failed write on a node becomes on the wire: a full disk says where, and how much room is missing.

A bare ``OSError: [Errno 28]`` tells the user neither which directory filled up nor how far it was
from enough; the message built here names the directory, the bytes still to write and the bytes
free there, so the fix (free that much, or sync somewhere else) is in the message.
"""

from __future__ import annotations

import errno
import os

from shared import protocol as p
from shared.rpc import RemoteError
from shared.sizes import size_text

#: The disk is full, or the user's quota on it is.
SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def free_bytes(directory: str) -> int | None:
    """What an unprivileged writer may still use under ``directory`` (the nearest existing one)."""
    info = _statvfs(directory)
    return None if info is None else info.f_bavail * info.f_frsize


def _statvfs(directory: str) -> os.statvfs_result | None:
    path = directory
    while path and not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    try:
        return os.statvfs(path or "/")
    except OSError:
        return None


def write_failed(exc: OSError, path: str, still: int) -> RemoteError | None:
    """The error to answer for ``exc``, raised while writing ``path`` with ``still`` bytes of the request
    not yet written; None for a failure that is not about room (the caller lets it go as it is)."""
    directory = os.path.dirname(path)
    reason = exc.strerror or str(exc)
    if exc.errno in SPACE_ERRNOS:
        info = _statvfs(directory)
        room = size_text(info.f_bavail * info.f_frsize) if info is not None else "an unknown amount"
        if info is not None and info.f_files and not info.f_favail:
            # Bytes free, but no inode: a file system given many small files runs out of files first.
            return RemoteError(p.NO_SPACE, f"no space left in {directory} ({reason}): no free inodes, all "
                                           f"{info.f_files:,} of its file system's are in use ({room} free); "
                                           f"{size_text(still)} still to write")
        return RemoteError(p.NO_SPACE, f"no space left in {directory} ({reason}): {size_text(still)} still to "
                                       f"write, {room} free")
    if exc.errno == errno.EFBIG:
        return RemoteError(p.NO_SPACE, f"cannot write {path} ({reason}): this node's file size limit (ulimit -f, "
                                       f"or the filesystem's) is below the file's size; {size_text(still)} still "
                                       "to write")
    return None
