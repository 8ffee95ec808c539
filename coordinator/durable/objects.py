"""The checkpoint store itself, through obstore (the Python binding of Rust's ``object_store``: S3 and
every S3-compatible store, GCS, Azure and local directories behind one client, with its own retries).

Every request has a time limit (``REQUEST_TIMEOUT_S`` per request, ``OPERATION_TIMEOUT_S`` for a
request and its retries): a store that stops answering fails the request, and coord tries again later.
Credentials come from each platform's standard variables (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``, else an AWS
profile: coordinator/durable/aws_profile.py;
``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_NAME``, ``AZURE_STORAGE_ACCOUNT_KEY``), read
by obstore, never by coord: nothing here logs, stores or sends them. A store's error is told as what
the user can do about it (``StoreError.hint``): the permission missing, the bucket missing, the
variable to set."""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

import anyio

from coordinator.config.store_url import StoreLocation
from coordinator.durable.aws_profile import profile_config

REQUEST_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
OPERATION_TIMEOUT_S = 180.0  # a request and obstore's retries of it
T = TypeVar("T")
_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_TRIES = re.compile(r"\d+ retries")
_STATUS = re.compile(r"non-2xx status code: (\d{3} [A-Za-z ]+?)(?::|$)")


class StoreError(Exception):
    """A request to the store that failed: ``kind`` (denied, credentials, no_bucket, not_found, timeout,
    failed), what happened in words, and what to do about it."""

    def __init__(self, kind: str, message: str, hint: str = ""):
        super().__init__(message)
        self.kind, self.message, self.hint = kind, message, hint

    def __str__(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


@dataclass(frozen=True)
class ObjectInfo:
    key: str  # relative to the store's location
    size: int
    modified: float  # wall clock


class ObjectStore(Protocol):
    """What coord asks of a store: whole objects in and out, a listing, and removal."""

    location: StoreLocation

    async def put(self, key: str, data: bytes) -> None: ...
    async def get(self, key: str) -> bytes: ...
    async def list_objects(self, prefix: str = "") -> list[ObjectInfo]: ...
    async def list_dirs(self, prefix: str = "") -> list[str]: ...
    async def delete(self, keys: list[str]) -> None: ...
    async def sign_puts(self, keys: list[str], expires_s: float) -> list[str] | None: ...


#: What a PUT to a signed URL needs beside it, by the store's kind.
PUT_HEADERS: dict[str, dict[str, str]] = {"az": {"x-ms-blob-type": "BlockBlob"}}


def _hint(location: StoreLocation, code: str, env: Mapping[str, str]) -> tuple[str, str]:
    where = location.url
    if code in ("NoSuchBucket", "ContainerNotFound"):
        return "no_bucket", (f"the bucket {location.bucket!r} does not exist: create it (aws s3 mb s3://"
                             f"{location.bucket}, or in the provider's console)"
                             + ("" if env.get("AWS_ENDPOINT_URL") or location.scheme != "s3" else
                                "; for R2, B2 or MinIO set AWS_ENDPOINT_URL to its endpoint"))
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                "AuthenticationFailed", "Unauthenticated"):
        return "credentials", (f"{where} did not accept the credentials ({code}): check AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones) in coordd's "
                               "environment" if location.scheme == "s3" else
                               f"{where} did not accept the credentials ({code}): check "
                               + ("GOOGLE_APPLICATION_CREDENTIALS" if location.scheme == "gs" else
                                  "AZURE_STORAGE_ACCOUNT_NAME and AZURE_STORAGE_ACCOUNT_KEY"))
    if code in ("AccessDenied", "Forbidden", "AuthorizationPermissionMismatch", "PermissionDenied"):
        return "denied", (f"the credentials may not do this on {where} ({code}): coord needs to list, read, "
                          "write and delete objects under the prefix (s3:ListBucket, s3:GetObject, s3:PutObject, "
                          "s3:DeleteObject)")
    return "failed", ""


def store_error(location: StoreLocation, exc: BaseException, doing: str,
                env: Mapping[str, str] | None = None) -> StoreError:
    """An obstore exception as a StoreError, with a hint where the store said why."""
    import obstore.exceptions as errors

    text = str(exc).split("\n\nDebug source:", 1)[0]
    found = _CODE.search(str(exc))
    code = found.group(1) if found else ""
    if not code and isinstance(exc, errors.PermissionDeniedError):
        code = "AccessDenied"
    elif not code and isinstance(exc, errors.UnauthenticatedError):
        code = "Unauthenticated"
    kind, hint = _hint(location, code, env if env is not None else os.environ)
    if kind == "failed":
        if isinstance(exc, (FileNotFoundError, errors.NotFoundError)):
            kind = "not_found"
        elif "error sending request" in text:  # refused, reset, no route: nothing answered
            endpoint = (env if env is not None else os.environ).get("AWS_ENDPOINT_URL") \
                if location.scheme == "s3" else None
            kind, hint = "timeout", (f"nothing answered at {endpoint or location.url}: is the store up and reachable "
                                     "from the head" + (", and AWS_ENDPOINT_URL right" if endpoint else "")
                                     + "? coord tries again later")
        elif isinstance(exc, TimeoutError) or "timed out" in text.lower() or "timeout" in text.lower():
            kind, hint = "timeout", f"{location.url} did not answer in time; coord tries again later"
        elif "credential" in text.lower():
            kind, hint = "credentials", ("no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                                         "in coordd's environment" if location.scheme == "s3" else
                                         "no credentials found for the store in coordd's environment")
    first_line = text.splitlines()[0] if text else exc.__class__.__name__
    answered = _STATUS.search(first_line)
    if answered:  # the store's own answer, without the client's account of the request around it
        first_line = f"the store answered {answered.group(1)}" + (f" ({code})" if code else "")
    elif "error sending request" in first_line:  # refused, reset, no route: nothing answered
        first_line = "no connection to the store" + (f" (after {tries.group(0)})" if (tries := _TRIES.search(
            first_line)) else "")
    return StoreError(kind, f"{doing} on {location.url} failed: {first_line[:300]}", hint)


_S3_CONFIG = (("aws_access_key_id", "AWS_ACCESS_KEY_ID"), ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY"),
              ("aws_session_token", "AWS_SESSION_TOKEN"), ("aws_region", "AWS_REGION"),
              ("aws_endpoint", "AWS_ENDPOINT_URL"))
_SAID_CODE = re.compile(r"\(([A-Za-z]+)\)")


def said_by_node(location: StoreLocation, node: str, message: str,
                 env: Mapping[str, str] | None = None) -> StoreError:
    """A node's report of the store's answer to a signed PUT (agent/store_put.py) as a StoreError."""
    found = _SAID_CODE.search(message)
    kind, hint = _hint(location, found.group(1) if found else "", env if env is not None else os.environ)
    if "expired" in message:
        kind, hint = "timeout", "the part took longer than its signed URL lasts; coord tries again later"
    elif kind == "failed":
        kind, hint = "timeout", f"{location.url} did not answer {node}; coord tries again later"
    return StoreError(kind, f"{node}'s upload to {location.url} failed: {message}", hint)


class ObstoreStore:
    """An ObjectStore over obstore, opened at the location (keys are relative to it)."""

    def __init__(self, location: StoreLocation, *, env: Mapping[str, str] | None = None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S, operation_timeout_s: float = OPERATION_TIMEOUT_S):
        from obstore.store import from_url

        self.location = location
        self._env = dict(env if env is not None else os.environ)
        self._limit = operation_timeout_s
        if location.scheme == "file":
            os.makedirs("/" + location.prefix, mode=0o700, exist_ok=True)
            self._store = from_url(location.url, mkdir=True)
            return
        options: dict[str, object] = {"timeout": f"{request_timeout_s:g}s",
                                      "connect_timeout": f"{CONNECT_TIMEOUT_S:g}s"}
        profile = profile_config(self._env) if location.scheme == "s3" else {}
        endpoint = self._env.get("AWS_ENDPOINT_URL", "") or profile.get("aws_endpoint", "")
        if location.scheme == "s3" and endpoint.startswith("http://"):
            options["allow_http"] = True  # a MinIO at home, without TLS: the user named it so
        retry: dict[str, object] = {"max_retries": 3, "retry_timeout": datetime.timedelta(seconds=operation_timeout_s),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=200),
                             "max_backoff": datetime.timedelta(seconds=10), "base": 2}}
        # Given an environment (a test's, a bench's), its credentials are passed as they are; else
        # obstore reads the process's own, as coordd runs.
        config = {key: self._env[name] for key, name in _S3_CONFIG if name in self._env} \
            if env is not None and location.scheme == "s3" else {}
        config.update(profile)  # an AWS profile's, where the environment names no keys
        self._store = from_url(location.url, config=cast(Any, config) or None, client_options=cast(Any, options),
                               retry_config=cast(Any, retry))

    async def _bounded(self, doing: str, call: Callable[[], Awaitable[T]]) -> T:
        try:
            with anyio.fail_after(self._limit):
                return await call()
        except StoreError:
            raise
        except TimeoutError:
            raise StoreError("timeout", f"{doing} on {self.location.url} took over {self._limit:g} s",
                             "the store stopped answering; coord tries again later") from None
        except Exception as exc:  # obstore's errors, an OSError of a file:// store
            raise store_error(self.location, exc, doing, self._env) from None

    async def put(self, key: str, data: bytes) -> None:
        import obstore

        await self._bounded(f"writing {key}", lambda: obstore.put_async(self._store, key, data))

    async def get(self, key: str) -> bytes:
        import obstore

        async def read() -> bytes:
            got = await obstore.get_async(self._store, key)
            return bytes(await got.bytes_async())
        result: bytes = await self._bounded(f"reading {key}", read)
        return result

    async def list_objects(self, prefix: str = "") -> list[ObjectInfo]:
        import obstore

        async def listing() -> list[ObjectInfo]:
            found: list[ObjectInfo] = []
            async for batch in obstore.list(self._store, prefix=prefix or None):
                found.extend(ObjectInfo(o["path"], o["size"], o["last_modified"].timestamp()) for o in batch)
            return found
        result: list[ObjectInfo] = await self._bounded(f"listing {prefix or '/'}", listing)
        return result

    async def list_dirs(self, prefix: str = "") -> list[str]:
        import obstore

        async def listing() -> list[str]:
            found = await obstore.list_with_delimiter_async(self._store, prefix or None)
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]
        result: list[str] = await self._bounded(f"listing {prefix or '/'}", listing)
        return result

    async def delete(self, keys: list[str]) -> None:
        import obstore

        if keys:
            await self._bounded(f"removing {len(keys)} objects", lambda: obstore.delete_async(self._store, keys))


    async def sign_puts(self, keys: list[str], expires_s: float) -> list[str] | None:
        """A URL for one PUT of each key, valid for ``expires_s`` (so that a node can put a part without
        credentials); None where the store cannot sign (a file:// store, credentials that sign nothing)."""
        import obstore

        if self.location.scheme == "file" or not keys:
            return None
        try:
            urls = await self._bounded("signing URLs", lambda: obstore.sign_async(
                cast(Any, self._store), "PUT", keys, datetime.timedelta(seconds=expires_s)))
        except StoreError:
            return None
        return [str(url) for url in urls]


def open_store(location: StoreLocation, env: Mapping[str, str] | None = None) -> ObstoreStore:
    return ObstoreStore(location, env=env)
