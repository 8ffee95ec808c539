"""The checkpoint store from the command line: `coord run --resume-from URL` (a run continued from its
newest committed checkpoint there, on a head and nodes that may never have seen it) and
`coord checkpoints --store URL` (what the store holds: runs, steps, sizes, committed or not).

Both run in the daemon, whose environment holds the store's credentials (as coordd's service file
sets them); what they say never holds a credential."""

from __future__ import annotations

import posixpath
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import anyio

from coordinator.config.store_url import StoreLocation, StoreUrlError, parse_checkpoint_dir, parse_store_url
from coordinator.durable.manifest import ManifestError, StoreManifest
from coordinator.durable.objects import ObjectStore, StoreError, open_store
from coordinator.durable.transfer import UploadDamaged, download_file, read_manifest
from coordinator.jobs.effects import HEAD
from coordinator.jobs.manager import StoredStart
from coordinator.jobs.replica import head_replica_parts
from shared import protocol as p
from shared.checkpoint_dirs import digest
from shared.errors import first_error
from shared.rpc import Emit, RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.manager import JobManager
    from coordinator.jobs.view import RunView
    from coordinator.nodes.cluster import Cluster


class StoredCheckpoint(TypedDict):
    run: str
    step: int
    attempt: int
    committed: bool
    bytes: int  # every object of it, its parts and manifest
    objects: int
    format: str | None  # from its manifest (None: not committed, or a manifest that is not coord's)
    url: str
    problem: str | None  # why a manifest that is there is not taken


class StoreListing(TypedDict):
    store: str
    checkpoints: list[StoredCheckpoint]


def _location(url: str) -> StoreLocation:
    try:
        return parse_store_url(url)
    except StoreUrlError as exc:
        raise RemoteError(p.BAD_ARGS, str(exc)) from None


MANIFESTS_AT_ONCE = 8


def _store_failed(exc: StoreError) -> RemoteError:
    return RemoteError(p.REFUSED, str(exc))


async def _checkpoints_of_run(store: ObjectStore, run: str) -> list[StoredCheckpoint]:
    """Every checkpoint directory under the run's prefix, newest first, committed or not."""
    found: dict[str, list[int]] = {}
    for obj in await store.list_objects(f"{run}/" if run else ""):
        rel = obj.key[len(run) + 1:] if run else obj.key
        name = rel.split("/", 1)[0]
        if parse_checkpoint_dir(name) is not None:
            found.setdefault(name, []).append(obj.size)
    listed: list[StoredCheckpoint] = []
    limit = anyio.Semaphore(MANIFESTS_AT_ONCE)

    async def describe(name: str) -> None:
        step, attempt = parse_checkpoint_dir(name) or (0, 0)
        prefix = f"{run}/{name}" if run else name
        manifest: StoreManifest | None = None
        problem = None
        async with limit:
            try:
                manifest = await read_manifest(store, prefix)
            except StoreError as exc:
                if exc.kind != "not_found":
                    raise
            except ManifestError as exc:
                problem = str(exc)
        listed.append({"run": run or store.location.last, "step": step, "attempt": attempt,
                       "committed": manifest is not None, "bytes": sum(found[name]), "objects": len(found[name]),
                       "format": manifest["format"] if manifest else None,
                       "url": store.location.below(*([run] if run else []), name).url, "problem": problem})

    # The manifests read a few at a time: one after another, a store across the internet took a tenth
    # of a second per checkpoint listed.
    try:
        async with anyio.create_task_group() as tasks:
            for name in found:
                tasks.start_soon(describe, name)
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    return sorted(listed, key=lambda c: (c["step"], c["attempt"]), reverse=True)


async def list_store(url: str) -> StoreListing:
    """`coord checkpoints --store URL`: URL is a store (its runs listed), a run's prefix, or one checkpoint's."""
    location = _location(url)
    try:
        if parse_checkpoint_dir(location.last) is not None:
            run_location = location.parent
            listed = [c for c in await _checkpoints_of_run(open_store(run_location.parent), run_location.last)
                      if c["url"] == location.url]
        else:
            store = open_store(location)
            names = await store.list_dirs("")
            if any(parse_checkpoint_dir(n) for n in names):  # a run's own prefix
                listed = await _checkpoints_of_run(open_store(location.parent), location.last)
            else:
                listed = [c for run in sorted(names) for c in await _checkpoints_of_run(store, run)]
    except StoreError as exc:
        raise _store_failed(exc) from None
    return {"store": location.url, "checkpoints": listed}


async def newest_committed(location: StoreLocation) -> tuple[StoreLocation, str, StoreManifest]:
    """The newest committed checkpoint under ``location`` (a run's prefix, or one checkpoint's): the run's
    location, the checkpoint's directory name, and its manifest checked."""
    if parse_checkpoint_dir(location.last) is not None:
        run, names = location.parent, [location.last]
    else:
        run = location
        below = await open_store(run).list_dirs("")
        names = sorted((n for n in below if parse_checkpoint_dir(n)),
                       key=lambda n: parse_checkpoint_dir(n) or (0, 0), reverse=True)
        if not names and below:  # the store's own prefix, whose runs are below it
            shown = ", ".join(sorted(below)[:5]) + (", ..." if len(below) > 5 else "")
            raise RemoteError(p.BAD_ARGS, f"{location.url} holds runs, not checkpoints ({shown}): give one run's "
                                          f"prefix, e.g. {location.below(sorted(below)[0]).url}; coord checkpoints "
                                          f"--store {location.url} lists them")
    store = open_store(run)
    skipped: list[str] = []
    for name in names:
        try:
            return run, name, await read_manifest(store, name)
        except StoreError as exc:
            if exc.kind != "not_found":
                raise
            skipped.append(f"{name} (no manifest: an upload that did not finish)")
        except ManifestError as exc:
            skipped.append(f"{name} ({exc})")
    found = f"; passed over: {', '.join(skipped[:5])}" if skipped else ""
    raise RemoteError(p.NOT_FOUND, f"no committed checkpoint under {location.url}{found}; coord checkpoints --store "
                                   f"{run.parent.url if run.prefix else run.url} lists what is there")


async def fetch_to_head(store: ObjectStore, name: str, manifest: StoreManifest, dest: Path,
                        emit: Emit) -> tuple[str, str]:
    """Every file of a committed checkpoint to ``dest`` (a file checkpoint's path, or a directory's),
    each checked against the manifest; the path and SHA256 the catalog takes (a directory's digest)."""
    files = manifest["files"]
    directory = manifest["format"] == "directory"
    total = max(manifest["bytes"], 1)
    done, said = 0, -1.0

    async def fetched(size: int) -> None:  # said at every tenth of the whole, not at every part
        nonlocal done, said
        done += size
        if done / total - said >= 0.1 or done == total:
            said = done / total
            await emit({"progress": f"fetched {done / 1e6:.1f} of {total / 1e6:.1f} MB", "fraction": said})
    try:
        for entry in files:
            target = dest / entry["path"] if directory else dest
            await download_file(store, name, entry, target, fetched=fetched)
    except BaseException:
        if directory:  # the files already fetched: a directory is used whole or not at all
            shutil.rmtree(dest, ignore_errors=True)
        raise
    if directory:
        return str(dest), digest([{"path": f["path"], "size": f["size"], "sha256": f["sha256"]} for f in files])
    return str(dest), files[0]["sha256"]


async def serve_run_from_store(cluster: Cluster, jobs: JobManager, emit: Emit, spec: dict[str, object],
                               url: str) -> RunView:
    """`coord run --resume-from URL`: the newest committed checkpoint there fetched to the head (the
    relay takes it to the nodes at launch, as any head copy), then the run continued from it."""
    location = _location(url)
    try:
        run, name, manifest = await newest_committed(location)
        await emit({"progress": f"found the checkpoint of step {manifest['step']} of run {manifest['run']} "
                                f"({manifest['bytes'] / 1e6:.1f} MB)"})
        jobs.check_from_store(dict(spec), manifest["run"], run.parent.url)  # before any byte is fetched
        started = time.monotonic()
        file_name = (f"{manifest['step']:07d}" if manifest["format"] == "directory"
                     else posixpath.basename(manifest["files"][0]["path"]))
        dest = cluster.config.state_dir.joinpath(*head_replica_parts(manifest["run"], manifest["attempt"], file_name))
        path, sha256 = await fetch_to_head(open_store(run), name, manifest, dest, emit)
    except StoreError as exc:
        raise _store_failed(exc) from None
    except (UploadDamaged, OSError) as exc:
        raise RemoteError(p.DAMAGED, f"the checkpoint in {run.below(name).url} could not be fetched: {exc}") from None
    seconds = time.monotonic() - started
    start = StoredStart(
        run_id=manifest["run"], attempt=manifest["attempt"], step=manifest["step"], store=run.parent.url,
        checkpoint={"step": manifest["step"], "attempt": manifest["attempt"], "node": HEAD, "path": path,
                    "sha256": sha256, "size": manifest["bytes"], "valid": True, "role": "replica",
                    "detail": f"fetched from {run.below(name).url}"},
        durable={"step": manifest["step"], "attempt": manifest["attempt"], "url": run.below(name).url,
                 "bytes": manifest["bytes"], "seconds": round(seconds, 3), "committed": manifest["created"]})
    return jobs.submit(dict(spec), from_store=start).view()
