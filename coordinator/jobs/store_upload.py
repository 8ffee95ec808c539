"""A checkpoint's upload by the nodes that hold it: each node puts a disjoint share of its parts
straight into the store, through URLs the head signs for each part, so that every uplink works at
once and no credential leaves the head (coordinator/durable/transfer.py's ``upload_spread``; the
node's side is agent/store_put.py). Where the store cannot sign (a NAS on the head: file://), or no
node with a copy is up, the head reads and puts the bytes itself."""

from __future__ import annotations

from collections.abc import Mapping

from coordinator.durable.objects import PUT_HEADERS, ObstoreStore, StoreError, said_by_node
from coordinator.durable.transfer import PartJob, SenderLost, SentPart, SpreadFile
from coordinator.nodes.session import UP, NodeSession
from shared import protocol as p
from shared.agent_api.store import StorePart
from shared.rpc import RemoteError

#: A signed URL lasts this long beyond the time its parts take at the slowest uplink coord plans for.
SIGNED_FOR_S = 300.0
SLOWEST_UPLINK = 1e6  # bytes per second: a home uplink's worst
CALL_MARGIN_S = 240.0  # beyond the parts' time: the node's retries of a part (agent/store_put.py)


class NodePartSender:
    """One node with a copy of the checkpoint: ``paths`` gives each file's path on it."""

    def __init__(self, session: NodeSession, store: ObstoreStore, paths: Mapping[int, str],
                 bandwidth: float | None):
        self.name = session.node.name
        self.session, self.store, self.paths, self.bandwidth = session, store, paths, bandwidth

    async def send(self, file_index: int, file: SpreadFile, jobs: list[PartJob], keys: list[str]) -> list[SentPart]:
        if self.session.state != UP:
            raise SenderLost(f"{self.name} is {self.session.state}")
        total = sum(job.size for job in jobs)
        slowest = min(self.bandwidth or SLOWEST_UPLINK, SLOWEST_UPLINK)
        urls = await self.store.sign_puts(keys, SIGNED_FOR_S + total / slowest)
        if urls is None:
            raise StoreError("failed", f"{self.store.location.url} could not sign URLs for the nodes' uploads")
        headers = PUT_HEADERS.get(self.store.location.scheme, {})
        parts: list[StorePart] = [{"offset": job.offset, "size": job.size, "url": url, "headers": headers}
                                  for job, url in zip(jobs, urls, strict=True)]
        try:
            reply = await self.session.call("store_put", {
                "workdir": self.session.node.workdir, "path": self.paths[file_index], "sha256": file.sha256,
                "parts": parts, "bandwidth": self.bandwidth}, timeout=CALL_MARGIN_S + total / slowest)
        except TimeoutError as exc:
            raise SenderLost(f"no answer in time ({exc})") from None
        except RemoteError as exc:
            if exc.code == p.STORE:
                raise said_by_node(self.store.location, self.name, exc.message) from None
            raise SenderLost(exc.message) from None  # gone, or its copy is not the one catalogued
        return [(part["size"], part["sha256"], (part["encoding"], part["stored"]) if "encoding" in part else None)
                for part in reply["parts"]]


def node_senders(sessions: Mapping[str, NodeSession], store: ObstoreStore, holders: Mapping[str, str],
                 files: list[SpreadFile], bandwidth: float | None, directory: bool) -> list[NodePartSender]:
    """A sender for each node up that holds a copy (``holders``: node -> the copy's path there)."""
    senders = []
    for node, path in sorted(holders.items()):
        session = sessions.get(node)
        if session is None or session.state != UP:
            continue
        paths = {index: f"{path}/{file.path}" if directory else path for index, file in enumerate(files)}
        senders.append(NodePartSender(session, store, paths, bandwidth))
    return senders
