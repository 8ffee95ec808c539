"""Where a checkpoint store is, and where each checkpoint's objects lie in it. Pure.

A store is a URL: ``s3://bucket/prefix`` (AWS, or any S3-compatible endpoint: Cloudflare R2,
Backblaze B2, MinIO; the endpoint comes from ``AWS_ENDPOINT_URL``), ``gs://bucket/prefix``,
``az://container/prefix``, or ``file:///mnt/nas/coord`` for a directory the head mounts (NFS, SMB).

Inside it, each run has a prefix of its own, and each checkpoint one under it::

    <prefix>/<run id>/step-0000040-attempt-1/manifest.json   written last: the commit
    <prefix>/<run id>/step-0000040-attempt-1/parts/0000-00000 the first part of the first file

A checkpoint's files are stored in parts of a fixed size, each an object of its own, so that
parts go up side by side (and from several machines), and each is checked on its own."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SCHEMES = ("s3", "gs", "az", "file")
MANIFEST = "manifest.json"
_CHECKPOINT_DIR = re.compile(r"^step-(\d{7,})-attempt-(\d+)$")
_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BUCKET = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")


class StoreUrlError(ValueError):
    """A checkpoint store's URL that cannot be used, with what to write instead."""


@dataclass(frozen=True)
class StoreLocation:
    """A store's URL taken apart: the bucket or container (empty for file://) and the path in it under
    which coord writes (no leading or trailing slash; for file://, the directory without its leading
    slash). The store is opened at this location: keys are relative to it."""

    scheme: str
    bucket: str
    prefix: str

    @property
    def url(self) -> str:
        if self.scheme == "file":
            return f"file:///{self.prefix}"
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def below(self, *parts: str) -> StoreLocation:
        """The location of a prefix under this one (a run's, a checkpoint's)."""
        return StoreLocation(self.scheme, self.bucket, "/".join(p for p in (self.prefix, *parts) if p))

    @property
    def parent(self) -> StoreLocation:
        """The location one level up (a checkpoint's run, a run's store)."""
        return StoreLocation(self.scheme, self.bucket, self.prefix.rpartition("/")[0])

    @property
    def last(self) -> str:
        """The prefix's last part ("" at a bucket's root)."""
        return self.prefix.rsplit("/", 1)[-1]


def parse_store_url(text: str) -> StoreLocation:
    """The store a URL names, or StoreUrlError saying what is wrong with it."""
    text = text.strip()
    split = urlsplit(text)
    scheme = split.scheme.lower()
    if scheme not in SCHEMES:
        raise StoreUrlError(f"{text!r} is not a checkpoint store: give s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
                            "az://CONTAINER/PREFIX or file:///PATH (a directory the head mounts)")
    if split.query or split.fragment:
        raise StoreUrlError(f"{text!r}: a checkpoint store's URL takes no ?query or #fragment (an S3-compatible "
                            "endpoint comes from AWS_ENDPOINT_URL)")
    if scheme == "file":
        if split.netloc not in ("", "localhost"):
            raise StoreUrlError(f"{text!r}: a file:// store is a directory on the head: file:///mnt/nas/coord "
                                "(three slashes)")
        path = split.path.strip("/")
        if not split.path.startswith("/") or not path or any(part in ("", ".", "..") for part in path.split("/")):
            raise StoreUrlError(f"{text!r}: give the directory as an absolute path below / without . or .. "
                                "(file:///mnt/nas/coord)")
        return StoreLocation("file", "", path)
    bucket = split.netloc
    if "@" in bucket or ":" in bucket:
        raise StoreUrlError(f"{text!r}: credentials and ports do not go in the URL; they come from the "
                            "environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...)")
    if not _BUCKET.match(bucket):
        raise StoreUrlError(f"{text!r}: {bucket or 'an empty name'} is not a bucket name")
    prefix = split.path.strip("/")
    if any(part in ("", ".", "..") for part in prefix.split("/")) and prefix:
        raise StoreUrlError(f"{text!r}: the prefix may not hold empty, . or .. parts")
    return StoreLocation(scheme, bucket, prefix)


def checkpoint_dir(step: int, attempt: int) -> str:
    return f"step-{step:07d}-attempt-{attempt}"


def parse_checkpoint_dir(name: str) -> tuple[int, int] | None:
    """(step, attempt) of a checkpoint's directory name, or None when it is not one."""
    found = _CHECKPOINT_DIR.match(name)
    return (int(found.group(1)), int(found.group(2))) if found else None


def part_name(file_index: int, part_index: int) -> str:
    return f"parts/{file_index:04d}-{part_index:05d}"


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise StoreUrlError(f"{run_id!r} is not a run id")
    return run_id
