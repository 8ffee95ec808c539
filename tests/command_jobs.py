"""Programs that ``--launcher command`` runs in the tests: a home-made socket program that trains one
number over every process (its own all-reduce through rank 0, at ``COORD_COORDINATOR_ADDR``), with the
checkpoint contract of docs/script-contract.md, and what its weight must be after N steps on a world of
W processes, to tell an exact resume; and a JAX program over ``jax.distributed``."""

from __future__ import annotations

#: Standard library and coord_script only. Rank 0 listens at the coordinator's port; every other process
#: connects and says its rank. Each step each process sends its gradient, rank 0 sums them in rank order
#: and sends the sum back (an all-reduce), and every process takes the same step. Rank 0 saves
#: ``state.json`` (the weight as written by repr, exact) and ``COMPLETE`` every COORD_SAVE_EVERY steps,
#: and ``final.json`` in the attempt's checkpoint directory at the end. ``--hold-at S`` makes the first
#: attempt's rank 1 stop in step S for good (a hang: it neither steps nor uses CPU).
SOCKETS = '''\
import argparse, json, os, socket, sys, time
import coord_script

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, required=True)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--hold-at", type=int, default=0)
args = parser.parse_args()
rank, world = int(os.environ["COORD_RANK"]), int(os.environ["COORD_WORLD_SIZE"])
host, port = os.environ["COORD_COORDINATOR_ADDR"].rsplit(":", 1)
host, port = host.strip("[]"), int(port)
print(f"rank {rank} of {world}, local {os.environ['COORD_LOCAL_RANK']}, node {os.environ['COORD_NODE_RANK']} "
      f"of {os.environ['COORD_NNODES']}, coordinator {host}:{port}", flush=True)

if rank == 0:
    server = socket.create_server(("", port), family=socket.AF_INET)
    server.settimeout(300)
    peers = {}
    while len(peers) < world - 1:
        conn, _ = server.accept()
        stream = conn.makefile("rw")
        peers[int(stream.readline())] = stream
    peers = [peers[r] for r in sorted(peers)]
else:
    deadline = time.monotonic() + 300
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.settimeout(None)
    stream = conn.makefile("rw")
    stream.write(f"{rank}\\n")
    stream.flush()


def allsum(value):
    if rank == 0:
        total = value
        for peer in peers:
            total += float(peer.readline())
        for peer in peers:
            peer.write(f"{total!r}\\n")
            peer.flush()
        return total
    stream.write(f"{value!r}\\n")
    stream.flush()
    return float(stream.readline())


start = coord_script.step_offset()
w = 0.0
if coord_script.resume_dir():
    with open(os.path.join(coord_script.resume_dir(), "state.json")) as handle:
        state = json.load(handle)
    w, start = state["w"], state["step"]
save_every = int(os.environ.get("COORD_SAVE_EVERY") or 0)
for step in range(start + 1, args.steps + 1):
    began = time.perf_counter()
    if args.hold_at and step == args.hold_at and rank == 1 and os.environ["COORD_ATTEMPT"] == "0":
        os.kill(os.getpid(), 19)  # SIGSTOP: held for good, as a rank stuck in a collective is
    target = rank + 1.0
    grad = allsum(w - target) / world
    loss = allsum((w - target) ** 2) / world
    w = w - 0.1 * grad
    compute = time.perf_counter() - began
    coord_script.report(step, loss=loss, compute_seconds=compute) if rank == 0 else \\
        coord_script.report(step, compute_seconds=compute)
    if rank == 0 and save_every and step % save_every == 0:
        directory = coord_script.checkpoint_dir(step - coord_script.step_offset())
        with open(os.path.join(directory, "state.json"), "w") as handle:
            json.dump({"w": w, "step": step}, handle)
        open(os.path.join(directory, "COMPLETE"), "w").close()
    time.sleep(args.sleep)
if rank == 0:
    with open(os.path.join(os.environ["COORD_CHECKPOINT_DIR"], "final.json"), "w") as handle:
        json.dump({"w": w, "world": world}, handle)
print(f"rank {rank} done: w={w!r}", flush=True)
'''


def expected_weight(steps: int, world: int, w: float = 0.0) -> float:
    """The socket program's weight after ``steps`` steps on ``world`` processes from weight ``w``, as it
    computes it."""
    for _ in range(steps):
        total = w - 1.0
        for rank in range(1, world):
            total += w - (rank + 1.0)
        w = w - 0.1 * (total / world)
    return w


#: JAX over jax.distributed, initialised from the variables ``--env-style jax`` sets, on CPU
#: with Gloo between the processes: each step a process's value is summed over every process
#: (``process_allgather``), and rank 0 reports the sum and writes it at the end.
JAX = '''\
import json, os, sys
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_cpu_collectives_implementation", "gloo")
import coord_script
jax.distributed.initialize(**coord_script.jax_distributed())
import jax.numpy as jnp
from jax.experimental import multihost_utils

steps = int(sys.argv[1])
rank = jax.process_index()
assert jax.process_count() == int(os.environ["COORD_WORLD_SIZE"]), (jax.process_count(), os.environ)
assert rank == int(os.environ["COORD_RANK"]), (rank, os.environ["COORD_RANK"])
total = 0.0
for step in range(1, steps + 1):
    gathered = multihost_utils.process_allgather(jnp.array([float(rank + step)]))
    total = float(jnp.sum(gathered))
    coord_script.report(step, loss=total) if rank == 0 else coord_script.report(step, compute_seconds=0.001)
if rank == 0:
    with open(os.path.join(os.environ["COORD_CHECKPOINT_DIR"], "final.json"), "w") as handle:
        json.dump({"total": total, "processes": jax.process_count(), "devices": jax.device_count()}, handle)
jax.distributed.shutdown()
'''
