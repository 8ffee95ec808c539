"""Checkpoint directories spread over an attempt's nodes, joined and completed on every node.

A PyTorch job writes a checkpoint directory (``0000040/``) on every node at once, each rank its own
part: Accelerate's ``random_states_R.pkl`` on rank R's node, a torch.distributed.checkpoint shard per
rank, the model and optimizer on rank 0's node. No node's part is a checkpoint by itself; a resume on
any set of nodes needs every part (accelerate#3010: resuming FSDP fails because ``.metadata`` is on
one node's disk only). So once the nodes' parts joined make a whole (its format judged by
:mod:`coordinator.jobs.checkpoint_formats`) and nothing is still being written, every node of the
attempt that lacks a file is sent it (through the relay, each file checked on arrival), and every
node's copy is catalogued as a whole, under one digest: from then on it is a checkpoint like any
other (a resume uses each node's own copy, replicas and retention work on it).

Beyond ``EVERY_NODE_UP_TO`` nodes, only ``WHOLE_COPIES`` nodes are completed (rank 0's first): at a
hundred nodes, completing each checkpoint on every node was the head's largest cost while a job trained
(each file relayed to 127 nodes, each copy catalogued), and a resume places the whole on the nodes that
lack it anyway, in one relayed copy, as it does a single file's.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping

from coordinator.jobs import catalog
from coordinator.jobs.checkpoint_formats import Joined, Verdict, join_parts, judge, written_last
from coordinator.jobs.effects import CatalogPorts, Placement
from coordinator.jobs.node_health import NodeHealth
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.transfer import CheckpointDamaged
from coordinator.store.state import CheckpointEntry, CheckpointRow
from shared.agent_api.ranks import CheckpointInfo
from shared.checkpoint_dirs import DIR_NAME
from shared.rpc import RemoteError

#: node -> what it listed of one attempt's checkpoint directories
Listings = Mapping[str, list[CheckpointInfo]]


#: Formats whose last file is written once every other is complete (the script's COMPLETE, written after
#: its own saves; torch.distributed.checkpoint's ``.metadata``, written by its coordinator once every rank's
#: writes returned): a whole of these is final when first seen. Not DeepSpeed's ``latest``: rank 0 writes it
#: after its own files, with no barrier before it, while the other ranks may still be writing their ZeRO
#: states (DeepSpeed 0.19, ``save_checkpoint``): a shard half written has its final name, so a DeepSpeed
#: whole counts once seen twice alike, as Accelerate's does.
WRITTEN_LAST = ("complete", "dcp")

#: An attempt of at most this many nodes has each checkpoint directory made whole on every node (a resume
#: then copies nothing); a larger one on WHOLE_COPIES nodes, so that one node's loss leaves two.
EVERY_NODE_UP_TO = 8
WHOLE_COPIES = 3


def completed_on(order: list[str], whole: set[str], usable: set[str]) -> list[str]:
    """The nodes of ``order`` to hold a directory whole: every usable node of a small attempt; of a large
    one, those whole already and then the first usable ones in rank order, until WHOLE_COPIES hold it."""
    if len(order) <= EVERY_NODE_UP_TO:
        return [node for node in order if node in whole or node in usable]
    chosen = {node for node in order if node in whole}
    for node in order:
        if len(chosen) >= WHOLE_COPIES:
            break
        if node in usable:
            chosen.add(node)
    return [node for node in order if node in chosen]


def settled(joined: Joined, verdict: Verdict, *, seen_before: str | None, newer_exists: bool,
            attempt_over: bool) -> bool:
    """Whether the verdict on a joined directory is final: its writers are done. A whole is final when
    its format writes a last file after the rest, else once the same bytes were seen at two polls in a
    row (Accelerate writes each file under its final name, a rank's random states last of its own), or a
    later step was written, or the ranks are stopped; a part is final only when nothing can still write it."""
    if attempt_over or newer_exists:
        return True
    return verdict.valid and (verdict.format in WRITTEN_LAST or seen_before == joined.digest)


class DirKeeper:
    """One run's checkpoint directories: joined across the attempt's nodes, completed on each, catalogued."""

    def __init__(self, ctx: RunContext, health: NodeHealth):
        self.ctx = ctx
        self.fx: CatalogPorts = ctx.fx
        self.health = health

    async def settle(self, attempt: int, start_step: int, order: list[str], listings: Listings,
                     known: dict[str, set[str]], seen: dict[str, str], *, attempt_over: bool,
                     world_size: int | None, current: bool) -> bool:
        """Judge each directory the nodes listed (not yet catalogued); complete and catalogue those
        settled. ``known`` (node -> names catalogued there) and ``seen`` (name -> digest at the last
        poll) are the attempt's own. True when one was catalogued valid."""
        by_name: dict[str, dict[str, CheckpointInfo]] = {}
        for node, entries in listings.items():
            for entry in entries:
                if entry.get("kind") == "dir":
                    by_name.setdefault(entry["name"], {})[node] = entry
        newest = max((int(name) for name in by_name), default=-1)
        judged = self._judged(attempt)
        validated = False
        for name in sorted(by_name):
            parts = by_name[name]
            if name in judged:
                # Judged already (with every node's part): what a node shows of it now is its own copy,
                # whole when its bytes are the whole's, else what an interrupted copy left.
                self._late_parts(attempt, start_step + int(name), order, parts, judged[name])
                for node in parts:
                    known.setdefault(node, set()).add(name)
                continue
            joined = join_parts(parts)
            verdict = judge(joined, world_size)
            if not settled(joined, verdict, seen_before=seen.get(name), newer_exists=int(name) < newest,
                           attempt_over=attempt_over):
                seen[name] = joined.digest
                continue
            seen.pop(name, None)
            step = start_step + int(name)
            complete: dict[str, str] = {}
            if verdict.valid:
                writers = sorted({n for holders in joined.holders.values() for n in holders})  # before any copy
                complete, chosen = await self._complete(attempt, step, name, order, joined, parts)
                self._catalogue(attempt, step, order, complete, joined, verdict, parts, chosen)
                validated = validated or bool(complete)
                self._announce(step, order, complete, writers, verdict, current)
            else:
                self._catalogue(attempt, step, order, {}, joined, verdict, parts, set())
                self.ctx.event("checkpoint_invalid", f"checkpoint of step {step} is not valid: {verdict.detail}",
                               step=step, **({"nonfinite": verdict.nonfinite} if verdict.nonfinite else {}))
            for node in {*parts, *complete}:  # catalogued there: not listed (nor hashed) again
                known.setdefault(node, set()).add(name)
        return validated

    def _judged(self, attempt: int) -> dict[str, str | None]:
        """The attempt's directories already catalogued (name -> the whole's digest, None when it was not
        valid), from each node's own copy (not coord's replicas)."""
        judged: dict[str, str | None] = {}
        for copy in self.fx.checkpoints(self.ctx.run_id):
            name = posixpath.basename(copy["path"])
            if copy["attempt"] != attempt or catalog.role(copy) == catalog.REPLICA or not DIR_NAME.match(name):
                continue
            if copy["valid"]:
                judged[name] = copy["sha256"]
            else:
                judged.setdefault(name, None)
        return judged

    def _late_parts(self, attempt: int, step: int, order: list[str], parts: Mapping[str, CheckpointInfo],
                    whole: str | None) -> None:
        for node, part in parts.items():
            same = whole is not None and part["valid"] and part["sha256"] == whole
            self.fx.add_checkpoint(self.ctx.run_id, {
                "step": step, "attempt": attempt, "node": node, "path": part["path"],
                "sha256": whole if same else None, "size": part["size"], "valid": same,
                "detail": "the whole, as catalogued" if same else
                "a part only: a copy here cut short, or a node the whole was not sent to",
                "created": self.fx.now(), "role": catalog.PRIMARY if order and node == order[0] else catalog.LOCAL})

    async def _complete(self, attempt: int, step: int, name: str, order: list[str], joined: Joined,
                        parts: Mapping[str, CheckpointInfo]) -> tuple[dict[str, str], set[str]]:
        """Send the nodes of ``order`` to hold the directory whole (``completed_on``) the files they lack;
        node -> its directory, for the nodes that hold the whole now; and the nodes chosen to. Each file
        goes to every node lacking it in one copy (the relay passes it from node to node): at a hundred
        nodes, one node after another was a hundred copies a file, each set up on its own, and a checkpoint
        a second never caught up."""
        complete: dict[str, str] = {}
        dirs = {node: part["path"] for node, part in parts.items()}  # node -> its directory, where it holds files
        lacking: dict[str, set[str]] = {}  # node -> the files it is to be sent
        paths: dict[str, str] = {}  # node -> its directory once whole
        whole = {node for node in order if not joined.missing_on(node)}
        chosen = completed_on(order, whole, {node for node in order if self.health.usable(node)})
        for node in chosen:
            view = self.fx.node(node)
            path = posixpath.join(view.workdir, "checkpoints", self.ctx.run_id, f"attempt-{attempt}", name)
            if node in whole:
                complete[node] = path
            else:
                dirs.setdefault(node, path)
                lacking[node], paths[node] = set(joined.missing_on(node)), path
        failed: set[str] = set()
        # A format's last file goes last here too: a copy cut short never looks whole.
        for rel in sorted({rel for wanted in lacking.values() for rel in wanted},
                          key=lambda path: (written_last(path), path)):
            nodes = [node for node, wanted in lacking.items() if rel in wanted and node not in failed]
            if not nodes:
                continue
            for node, problem in (await self._send(attempt, step, name, nodes, rel, joined, dirs)).items():
                if problem is None:
                    # A node that has a file now is a holder of it: a node sent it alone later (after
                    # a copy to many failed) is sent it from another once its writer went away.
                    joined.holders[rel].append(node)
                else:
                    self.ctx.log.warning("checkpoint part not sent", node=node, step=step, reason=problem)
                    failed.add(node)
        for node in lacking:
            if node not in failed:
                complete[node] = paths[node]
        return {node: complete[node] for node in order if node in complete}, set(chosen)

    async def _send(self, attempt: int, step: int, name: str, nodes: list[str], rel: str, joined: Joined,
                    dirs: Mapping[str, str]) -> dict[str, str | None]:
        """``rel`` to ``nodes``: node -> None when it holds the file now, else why not. All at once; when
        that fails, once more without the nodes gone meanwhile, then node by node (one node's loss must
        not cost the others their copy)."""
        entry = joined.files[rel]
        target = f"checkpoints/{self.ctx.run_id}/attempt-{attempt}/{name}/{rel}"

        async def copy(batch: list[str]) -> tuple[str | None, bool]:
            """Why the copy to ``batch`` failed (None when it did not), and whether the source was damaged."""
            holder = next((n for n in joined.holders[rel] if self.health.reachable(n)), None)
            if holder is None:  # its holders went away after they listed it: these stay parts for now
                return f"no node holding {rel} is reachable ({', '.join(joined.holders[rel])})", False
            source: CheckpointRow = {
                "step": step, "attempt": attempt, "node": holder, "path": posixpath.join(dirs[holder], rel),
                "sha256": entry["sha256"], "size": entry["size"], "valid": True, "detail": None,
                "created": self.fx.now(), "role": catalog.PRIMARY}
            try:
                await self.fx.copy_checkpoint(source, [Placement(node, target) for node in batch])
            except CheckpointDamaged as exc:
                return str(exc), True
            except (RemoteError, OSError) as exc:
                return exc.message if isinstance(exc, RemoteError) else str(exc), False
            return None, False

        problem, damaged = await copy(nodes)
        if problem is None or damaged or len(nodes) == 1:
            return {node: problem for node in nodes}
        result: dict[str, str | None] = {node: problem for node in nodes if not self.health.usable(node)}
        rest = [node for node in nodes if node not in result]
        if len(rest) > 1:
            again, damaged = await copy(rest)
            if again is None or damaged:
                return {**result, **{node: again for node in rest}}
        for node in rest:
            result[node] = (await copy([node]))[0]
        return result

    def _catalogue(self, attempt: int, step: int, order: list[str], complete: Mapping[str, str], joined: Joined,
                   verdict: Verdict, parts: Mapping[str, CheckpointInfo], chosen: set[str]) -> None:
        """Each whole copy as valid, under the joined digest; each node's part that is not whole as not
        valid (so that retention removes it with its step). ``chosen``: the nodes meant to hold it whole."""
        for node in sorted(set(complete) | set(parts)):
            role = catalog.PRIMARY if order and node == order[0] else catalog.LOCAL
            whole = node in complete
            entry: CheckpointEntry = {
                "step": step, "attempt": attempt, "node": node, "path": complete.get(node) or parts[node]["path"],
                "sha256": joined.digest if whole else None, "size": joined.size if whole else parts[node]["size"],
                "valid": whole, "detail": verdict.detail if whole else f"a part only: {verdict.detail}"
                if not verdict.valid else "a part only: the rest could not be sent here" if node in chosen
                else f"a part only: whole on {', '.join(complete)} (a resume places it where a rank needs it)",
                "created": self.fx.now(), "role": role}
            self.fx.add_checkpoint(self.ctx.run_id, entry)

    def _announce(self, step: int, order: list[str], complete: Mapping[str, str], writers: list[str],
                  verdict: Verdict, current: bool) -> None:
        if not complete:
            self.ctx.event("checkpoint_invalid", f"checkpoint of step {step} is whole, but no node could be sent "
                           "its parts", step=step)
            return
        last = self.ctx.record.last_checkpoint
        node = order[0] if order and order[0] in complete else sorted(complete)[0]
        if last is None or step >= last["step"]:
            self.ctx.record.last_checkpoint = {"step": step, "time": self.fx.now(), "node": node}
        self.ctx.event("checkpoint", f"checkpoint of step {step} validated ({verdict.detail}"
                       + (f", joined from {', '.join(writers)}" if len(writers) > 1 else "")
                       + f"; whole on {', '.join(sorted(complete))})"
                       + ("" if current else ", written while its nodes were away"), step=step,
                       nodes=sorted(complete))

