"""Checkpoints off the failing machine: each validated checkpoint is copied, in the background,
to a second place (the head's state directory, or another node) and entered in the catalog
as a replica once its SHA256 matched on arrival. With a trainer whose rank 0 alone saves
(mlx-lm's), the newest checkpoint is also copied to every other node of the attempt, in the
same stream (``copy_checkpoint`` with several placements), so that a resume finds it in place.

Copies run one at a time, newest first, and never in the training path: the ranks keep
training while the daemon streams the file from rank 0's agent. A copy that fails is tried
again at the next checkpoint, and once more before the run is called succeeded. When the head
is rank 0's own machine and another machine already holds the checkpoint (coord's trainer:
every rank's own copy), the head's copy is not made: it would protect nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from coordinator.jobs import catalog
from coordinator.jobs.effects import HEAD, CatalogPorts, Placement
from coordinator.jobs.spec import REPLICA_HEAD
from coordinator.jobs.transfer import CheckpointDamaged
from coordinator.launch.mlx_lm_command import is_mlx_lm
from coordinator.launch.trainers import trainer_declared
from coordinator.store.state import CheckpointRow
from shared.rpc import RemoteError

if TYPE_CHECKING:
    from coordinator.jobs.node_health import NodeHealth
    from coordinator.jobs.run_context import RunContext


def head_replica_parts(run_id: str, attempt: int, name: str) -> tuple[str, ...]:
    return ("replicas", run_id, f"attempt-{attempt}", name)


def node_replica_rel(run_id: str, attempt: int, name: str) -> str:
    return f"checkpoints/{run_id}/replica/attempt-{attempt}/{name}"


class Replicator:
    def __init__(self, ctx: RunContext, health: NodeHealth):
        self.ctx = ctx
        self.fx: CatalogPorts = ctx.fx
        self.health = health
        self._wake = anyio.Event()
        self._one_at_a_time = anyio.Lock()  # the background loop and the run's final copy take turns

    def poke(self) -> None:
        """A new checkpoint was validated."""
        self._wake.set()

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            await self.replicate_pending()

    def _spread_to(self) -> list[str]:
        """The nodes that should hold the newest checkpoint before anything fails: with a trainer
        whose rank 0 alone saves (mlx-lm's), every node of the attempt; with coord's, none (each
        rank writes its own copy on its own node)."""
        run = self.ctx
        if trainer_declared(run.spec.trainer).every_rank_saves or not is_mlx_lm(run.spec.command):
            return []  # coord's trainer: each rank's own copy; a script of one's own: as before, rank 0's
        return [n for n in run.record.order or [] if n in run.fx.node_names()]

    async def replicate_pending(self, *, final: bool = False) -> None:
        """Every background copy still wanted, newest checkpoint first. ``final``: only the copy off
        the primary's machine (nothing follows the run's last checkpoint that needs it on every node)."""
        run = self.ctx
        async with self._one_at_a_time:
            wanted = catalog.copies_wanted(run.fx.checkpoints(run.run_id), run.spec.keep,
                                           target=run.spec.replica, spread_to=[] if final else self._spread_to(),
                                           same_machine=self.health.same_machine,
                                           head_is_a_node=any(run.fx.on_head_machine(n) for n in run.job_nodes()))
            for one in wanted:
                await self.replicate(one.source, one.targets)

    async def replicate(self, primary: CheckpointRow, targets: list[str] | None = None) -> None:
        """Copy one checkpoint to ``targets`` (node names or ``REPLICA_HEAD``) in one verified stream;
        each copy that lands is catalogued as a replica on its node."""
        run, fx = self.ctx, self.fx
        if primary["node"] != HEAD and (primary["node"] not in fx.node_names() or not fx.node(primary["node"]).up):
            return  # its node is away; the resume will use an older replica or this primary when it is back
        name = primary["path"].rsplit("/", 1)[-1]
        placements: list[Placement] = []
        for target in targets if targets is not None else [run.spec.replica]:
            if target != REPLICA_HEAD and (target == primary["node"] or target not in fx.node_names()
                                           or not fx.node(target).up):
                if target != run.spec.replica:
                    continue  # a node away gets it at the next checkpoint, or when it resumes
                target = REPLICA_HEAD  # a copy on the same machine protects nothing; a node away cannot take it
            if target == REPLICA_HEAD:
                placement = Placement(HEAD, fx.head_path(*head_replica_parts(run.run_id, primary["attempt"], name)))
            else:
                placement = Placement(target, node_replica_rel(run.run_id, primary["attempt"], name))
            if placement not in placements:
                placements.append(placement)
        if not placements:
            return
        where = ", ".join(f"{p.node}:{p.path}" for p in placements)
        started = fx.monotonic()
        try:
            paths = await fx.copy_checkpoint(primary, placements)
        except (RemoteError, CheckpointDamaged, OSError) as exc:
            reason = exc.message if isinstance(exc, RemoteError) else str(exc)
            run.event("replica_failed", f"checkpoint of step {primary['step']} not copied to {where}: "
                         f"{reason}", step=primary["step"])
            return
        seconds = fx.monotonic() - started
        # The primary may have been found bad meanwhile (replicas that diverged invalidate
        # what was saved after it): the copy is no better than its original.
        now = next((c for c in fx.checkpoints(run.run_id)
                    if c["attempt"] == primary["attempt"] and c["node"] == primary["node"]
                    and c["path"] == primary["path"]), None)
        valid = now is not None and now["valid"]
        detail = (f"replica of {primary['node']}:{primary['path']}" if valid else
                  f"replica of an invalid checkpoint: {now['detail'] if now else 'its primary was removed'}")
        for placement, path in zip(placements, paths, strict=True):
            fx.add_checkpoint(run.run_id, {**primary, "node": placement.node, "path": path,
                                              "role": catalog.REPLICA, "valid": valid, "detail": detail,
                                              "created": fx.now()})
        run.event("replicated", f"checkpoint of step {primary['step']} copied to {where} in {seconds:.2f} s "
                     f"({(primary['size'] or 0) / max(seconds, 1e-6) / 1e6:.0f} MB/s), SHA256 checked on arrival",
                     step=primary["step"], seconds=round(seconds, 3), bytes=primary["size"],
                     targets=[p.node for p in placements])
