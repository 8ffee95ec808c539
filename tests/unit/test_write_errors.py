"""A failed write on a node, said in words: where, how much is missing, and whether bytes or inodes ran out."""

from __future__ import annotations

import errno
import os

from agent import write_errors
from shared import protocol as p


def _statvfs(*, bavail: int, favail: int, files: int = 262_144):
    # (bsize, frsize, blocks, bfree, bavail, files, ffree, favail, flag, namemax)
    return os.statvfs_result((4096, 4096, 1 << 20, bavail, bavail, files, favail, favail, 0, 255))


def test_a_full_disk_says_where_how_much_is_still_to_write_and_what_is_free(monkeypatch, tmp_path):
    monkeypatch.setattr(write_errors.os, "statvfs", lambda path: _statvfs(bavail=256, favail=1000))
    error = write_errors.write_failed(OSError(errno.ENOSPC, "No space left on device"), f"{tmp_path}/d/f.bin", 5 << 20)
    assert error is not None and error.code == p.NO_SPACE
    assert error.message == (f"no space left in {tmp_path}/d (No space left on device): 5.0 MiB (5242880 bytes) "
                             "still to write, 1.0 MiB (1048576 bytes) free")


def test_a_file_system_out_of_inodes_says_so_not_only_its_free_bytes(monkeypatch, tmp_path):
    """Seen on a node given round after round of 20,000 small files: 2.6 GiB free and "no space left"."""
    monkeypatch.setattr(write_errors.os, "statvfs", lambda path: _statvfs(bavail=700_000, favail=0))
    error = write_errors.write_failed(OSError(errno.ENOSPC, "No space left on device"), f"{tmp_path}/d/f.txt", 1024)
    assert error is not None and error.code == p.NO_SPACE
    assert error.message.startswith(f"no space left in {tmp_path}/d (No space left on device): no free inodes, "
                                    "all 262,144 of its file system's are in use (2.7 GiB")
    assert error.message.endswith("1.0 KiB (1024 bytes) still to write")


def test_a_failure_that_is_not_about_room_is_left_as_it_is(tmp_path):
    assert write_errors.write_failed(OSError(errno.EACCES, "Permission denied"), f"{tmp_path}/f", 1) is None
