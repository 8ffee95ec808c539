"""Benchmark: checkpoints into an S3 store, coord against the head alone and a client run by hand.

On the multi-host test cluster (network namespaces, one OpenSSH sshd, user and venv per node; needs
root on Linux), each node's uplink capped with `tc tbf` (100 Mbit/s by default), the head's link not:
the S3 server (moto's, its own process) runs in the head's namespace, so what limits an upload is the
uplink of the machine that holds the bytes, as with a bucket in the cloud. In one run:

1. **A 1 GiB checkpoint into the store.** A job's script writes the same 1 GiB checkpoint directory
   on each of the 3 nodes (a data-parallel checkpoint: every node holds a copy), with no replica to
   the head (its copy would share the uplinks with the upload measured):
   - coord, default: each node puts a share of the parts through URLs the head signs;
   - coord with `--store-from head`: the head reads the bytes from the node and puts them;
   - by hand from one node: obstore's `put` of the file (multipart, 12 parts at once), and boto3's
     `upload_file` (multipart, 10 threads): the best a user's script does.
   The goal: at most 1.2x (size / the nodes' aggregate uplink).
2. **Training speed while uploading**: coord's trainer on the tiny model over 3 nodes, a checkpoint
   every 10 steps, with the store against without (steps per second over steps 50 to 300).
3. **Time to the first step of a resume**: the same run stopped at step 100 or later, resumed
   locally (`coord run --resume`), and on a fresh cluster from the store (`--resume-from`: every
   workdir and the head's state wiped, a new daemon).

    sudo python bench/checkpoint_store.py [--size-mib 1024] [--rate 100mbit]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.cluster.jobs import readable_project  # noqa: E402
from tests.cluster.netns import NetnsCluster, NodeSpec  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, installed_environment, short_tempdir  # noqa: E402
from tests.s3_server import S3Server  # noqa: E402

STORE = "s3://ckpt/bench"
CKPT = '''\
import argparse, os, random
import coord_script

parser = argparse.ArgumentParser()
parser.add_argument("--mib", type=int, required=True)
args = parser.parse_args()
directory = coord_script.checkpoint_dir(1)
block = random.Random(7).randbytes(1 << 20)  # the same bytes on every node: a data-parallel copy
with open(os.path.join(directory, "weights.bin"), "wb") as handle:
    for index in range(args.mib):
        handle.write(block[index % 997:] + block[:index % 997])
open(os.path.join(directory, "COMPLETE"), "w").close()
coord_script.report(1, 0.0)
'''
TRAIN = ["python", "-m", "mlx_lm", "lora", "--model", "model", "--train", "--data", "data", "--fine-tune-type",
         "full", "--batch-size", "3", "--iters", "300", "--learning-rate", "1e-4"]
BY_HAND = {
    "obstore": '''import sys, time, obstore
from obstore.store import S3Store
store = S3Store("ckpt", endpoint=sys.argv[2], allow_http=True, region="us-east-1")
started = time.perf_counter()
obstore.put(store, "by-hand/obstore.bin", open(sys.argv[1], "rb"), chunk_size=32 << 20)
print(time.perf_counter() - started)''',
    "boto3": '''import sys, time, boto3
client = boto3.client("s3", endpoint_url=sys.argv[2], region_name="us-east-1")
started = time.perf_counter()
client.upload_file(sys.argv[1], "ckpt", "by-hand/boto3.bin")
print(time.perf_counter() - started)'''}


def nodes() -> list[NodeSpec]:
    return [NodeSpec(f"n{i}", f"coordbench{i}", f"/home/coordbench{i}", f"/home/coordbench{i}/venv")
            for i in range(1, 4)]


def job(daemon: DaemonProcess, name: str) -> dict:
    return next(j for j in daemon.status()["jobs"] if j["name"] == name)


def events(daemon: DaemonProcess, name: str, kind: str) -> list[dict]:
    return [e for e in daemon.status(events=2000)["events"] if e["kind"] == kind and e["message"].startswith(name)]


def run(daemon: DaemonProcess, project: Path, name: str, *args: str, detach: bool = False) -> None:
    done = coord("run", "--config", str(daemon.config), "--name", name, "--source", str(project),
                 *(["--detach"] if detach else []), *args, env=daemon.env, timeout=3600)
    assert done.returncode == 0, done.stdout + done.stderr


def steps_per_s(cluster: NetnsCluster, final: dict) -> float:
    node = cluster.node(final["nodes"][0])
    progress = Path(node.workdir) / ".coord" / "jobs" / final["run_id"] / f"attempt-{final['attempt']}" / "rank-0" \
        / "progress.jsonl"
    times = {r["step"]: r["time"] for r in map(json.loads, progress.read_text().splitlines()) if r["kind"] == "train"}
    return (300 - 50) / (times[300] - times[50])


def first_step_after(daemon: DaemonProcess, name: str, start: float, resumed_from: int) -> float:
    """Seconds from ``start`` until the job's step passes the one it resumed from."""
    while True:
        now = next((j for j in daemon.status()["jobs"] if j["name"] == name), None)
        if now is not None and now["state"] == "running" and now["step"] > resumed_from:
            return time.perf_counter() - start
        assert now is None or now["state"] not in ("failed", "succeeded"), now
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--rate", default="100mbit", help="each node's uplink (tc tbf rate)")
    parser.add_argument("--measure", default="upload,train,resume", help="which of the three to measure")
    args = parser.parse_args()
    root = short_tempdir("coord-bench-store-")
    project = readable_project(root)
    (project / "ckpt.py").write_text(CKPT)
    (project / "ckpt.py").chmod(0o644)
    out: dict[str, float] = {}
    with NetnsCluster(nodes()) as cluster:
        cluster.cap_links(args.rate, hosts=[n.name for n in cluster.nodes])
        server = S3Server(host=cluster.head_ip, prefix=["ip", "netns", "exec", cluster.head_ns]).start()
        env = {**installed_environment(), **server.env}

        def start(state: str) -> DaemonProcess:
            config = cluster.write_cluster_toml(root / f"{state}.toml", state_dir=root / state)
            daemon = DaemonProcess(config, env=env, prefix=["ip", "netns", "exec", cluster.head_ns]).start()
            daemon.wait_for(all_up, 120, "all nodes up")
            return daemon

        daemon = start("state1")
        try:
            measure = args.measure.split(",")
            for name, extra in (("big-nodes", []), ("big-head", ["--store-from", "head"])) if "upload" in measure \
                    else ():
                # No replica to the head: its copy would share the uplinks with the upload measured.
                run(daemon, project, name, "--checkpoint-store", STORE, "--replica", "none", *extra, "--", "python",
                    "ckpt.py", "--mib", str(args.size_mib))
                (durable,) = events(daemon, name, "job.durable")
                out[name] = durable["data"]["seconds"]
                print(f"{name}: {durable['message']}", file=sys.stderr, flush=True)
            final = job(daemon, "big-nodes") if "upload" in measure else None
            copy = None if final is None else next(Path(cluster.node("n1").workdir).glob(f"checkpoints/{final['run_id']}/attempt-0/0000001/"
                                                                "weights.bin"))
            for client, script in BY_HAND.items() if copy is not None else ():
                done = subprocess.run(["ip", "netns", "exec", cluster._ns["n1"], sys.executable, "-c", script, str(copy),
                                       server.endpoint], capture_output=True, text=True, env={**os.environ, **server.env},
                                      check=True)
                out[client] = float(done.stdout.strip())
                print(f"{client} by hand from n1: {out[client]:.1f} s", file=sys.stderr, flush=True)

            for name, extra in (("train-plain", []), ("train-store", ["--checkpoint-store", STORE])) \
                    if "train" in measure else ():
                run(daemon, project, name, "--trainer", "coord", "--save-every", "10", *extra, "--", *TRAIN)
                out[name] = steps_per_s(cluster, job(daemon, name))
            if "resume" not in measure:
                return report(args, out)
            run(daemon, project, "resume-me", "--trainer", "coord", "--save-every", "10", "--checkpoint-store", STORE,
                "--", *TRAIN, detach=True)
            daemon.wait_for(lambda d: ((next(j for j in d["jobs"] if j["name"] == "resume-me").get("durability") or {})
                                       .get("durable_step") or 0) >= 100, 600, "a checkpoint of step 100 in the store")
            coord("stop", "--config", str(daemon.config), "resume-me", env=daemon.env, timeout=300)
            stopped = job(daemon, "resume-me")
            started = time.perf_counter()
            done = coord("run", "--config", str(daemon.config), "--resume", "resume-me", "--detach", env=daemon.env,
                         timeout=600)
            assert done.returncode == 0, done.stdout + done.stderr
            out["resume-local"] = first_step_after(daemon, "resume-me", started, stopped["last_checkpoint_step"])
            coord("stop", "--config", str(daemon.config), "resume-me", env=daemon.env, timeout=300)
            stopped = job(daemon, "resume-me")
        finally:
            daemon.stop()
        for spec in cluster.nodes:  # the whole cluster lost
            shutil.rmtree(Path(spec.workdir) / "checkpoints", ignore_errors=True)
            shutil.rmtree(Path(spec.workdir) / ".coord", ignore_errors=True)
        daemon = start("state2")
        try:
            started = time.perf_counter()
            run(daemon, project, "resume-me", "--resume-from", f"{STORE}/{stopped['run_id']}", "--trainer", "coord",
                "--save-every", "10", "--", *TRAIN, detach=True)
            out["resume-store"] = first_step_after(daemon, "resume-me", started, stopped["durability"]["durable_step"])
            began = time.time() - out["resume-store"]
            for event in daemon.status(events=2000)["events"]:  # where the time went
                if event["message"].startswith("resume-me") and event["ts"] >= began - 1:
                    print(f"  +{event['ts'] - began:5.1f} s {event['kind']}: {event['message'][:150]}",
                          file=sys.stderr, flush=True)
        finally:
            daemon.stop()
            server.stop()
    shutil.rmtree(root, ignore_errors=True)
    report(args, out)


def report(args: argparse.Namespace, out: dict[str, float]) -> None:
    size = args.size_mib << 20
    rate = float(args.rate.removesuffix("mbit")) * 1e6 / 8 if args.rate.endswith("mbit") else None
    ideal = size / (3 * rate) if rate else float("nan")
    print(f"\n{args.size_mib} MiB checkpoint, 3 nodes each with a {args.rate} uplink (tc tbf), the S3 server "
          f"(moto) beside the head; {os.cpu_count()} cores\n")
    print("| measure | coord | against | ratio |")
    print("|---|---:|---:|---:|")
    if "big-nodes" in out:
        print(f"| upload (s): the nodes, each a share | {out['big-nodes']:.1f} | ideal size / 3 uplinks "
              f"{ideal:.1f} | {out['big-nodes'] / ideal:.2f}x (goal <= 1.2x) |")
        print(f"| upload (s): against the head alone (--store-from head) | {out['big-nodes']:.1f} | "
              f"{out['big-head']:.1f} | {out['big-head'] / out['big-nodes']:.2f}x faster |")
        for client in BY_HAND:
            print(f"| upload (s): against {client} by hand from one node | {out['big-nodes']:.1f} | {out[client]:.1f} "
                  f"| {out[client] / out['big-nodes']:.2f}x faster |")
    if "train-store" in out:
        print(f"| training (steps/s) with uploads, against no store | {out['train-store']:.2f} | "
              f"{out['train-plain']:.2f} | {out['train-store'] / out['train-plain']:.3f}x (goal >= 0.98x) |")
    if "resume-store" in out:
        print(f"| resume to first step (s): from the store on a fresh cluster, against a local resume | "
              f"{out['resume-store']:.1f} | {out['resume-local']:.1f} | "
              f"{out['resume-store'] / out['resume-local']:.2f}x |")


if __name__ == "__main__":
    main()
