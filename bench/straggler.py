"""Benchmark: the watch of stragglers, its detection delay, its false alarms and its cost.

Detection (the rule of ``coordinator/jobs/straggler.py`` over simulated ranks, many seeds):
ranks beat every 2 s with a jittered phase and ±25% noise on their compute time, the head polls
every 2 s (as the rank watch does with its 2 s holds), and one rank turns 4x slower at a random
moment: the delay from that moment to its naming, for steps of 0.05 s and of 12 s (longer than the
window). False stragglers: 30 minutes of the same ranks without a slow one, with a checkpoint
every 60 s that holds one rank's step (a script that saves inside its step) for 3 s, an evaluation
every 5 minutes (no step for 20 s), and a first epoch whose steps are 3x slower on one rank.
The delay on the real cluster (a cgroup quota on one rank of coord's trainer) is the cluster test's
``tests/cluster/test_stragglers_multihost.py``, which prints it.

Cost: what the per-rank measurement adds beyond what coord did before, per node, as a share of one
core: the rank's heartbeat carrying its compute time (``Heartbeat.step(compute_s=...)`` per step and
the beat's two more fields every 2 s), the head reading them (``read_heartbeat``) and the rule's
evaluation per poll; and, once per straggler named, the agent's one-second sample
(``rank_signals``: its CPU time, without the sleep).

    python bench/straggler.py [--seeds 200] [--steps-per-second 20]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from agent import rank_signals  # noqa: E402
from agent.heartbeat import Heartbeat  # noqa: E402
from coordinator.jobs.progress import read_heartbeat  # noqa: E402
from coordinator.jobs.straggler import StragglerDetector  # noqa: E402

BEAT_S = 2.0
POLL_S = 2.0


def _beats(rng: random.Random, step_s: float, slow: float, since: float, until: float) -> list[tuple[float, float]]:
    """One rank's compute reports between ``since`` and ``until``: a beat every 2 s with the mean of
    the steps finished since the beat before (none when no step finished), ``slow`` x from ``since``."""
    out = []
    t = since + rng.uniform(0, BEAT_S)
    step_end, done = since, []
    while t < until:
        while step_end + step_s * slow <= t:
            step_end += step_s * slow
            done.append(step_s * slow * rng.uniform(0.8, 1.25))
        if done:
            out.append((t, sum(done) / len(done)))
            done = []
        t += BEAT_S
    return out


def _run(reports: dict[int, list[tuple[float, float]]], until: float, watch_rank: int | None = None,
         onset: float = 0.0) -> tuple[float | None, int]:
    """The head polls every 2 s and feeds what came since; returns (delay of ``watch_rank``'s
    naming after ``onset``, how many namings in all)."""
    detector = StragglerDetector()
    merged = sorted((at, rank, value) for rank, items in reports.items() for at, value in items)
    index, t, named, delay = 0, 0.0, 0, None
    while t < until:
        t += POLL_S
        while index < len(merged) and merged[index][0] <= t:
            detector.add(merged[index][1], t, merged[index][2])
            index += 1
        for change in detector.evaluate(t):
            if change.kind == "named":
                named += 1
                if change.rank == watch_rank and delay is None and t >= onset:
                    delay = t - onset
    return delay, named


def detection_delay(seed: int, step_s: float, ranks: int = 3, slowdown: float = 4.0) -> float | None:
    rng = random.Random(seed)
    onset = rng.uniform(60, 120)
    until = onset + max(300.0, 40 * step_s * slowdown)
    reports = {rank: _beats(rng, step_s, 1.0, 0.0, until) for rank in range(ranks)}
    reports[0] = ([r for r in _beats(rng, step_s, 1.0, 0.0, onset)]
                  + _beats(rng, step_s, slowdown, onset, until))
    delay, _ = _run(reports, until, watch_rank=0, onset=onset)
    return delay


def false_stragglers(seed: int, ranks: int = 3, minutes: float = 30.0, step_s: float = 0.05) -> int:
    """Namings in a run without a slow rank: a first epoch (60 s) 3x slower on every rank, unevenly;
    a checkpoint every 60 s that holds rank 0's step 3 s; an evaluation every 5 minutes (no step for 20 s)."""
    rng = random.Random(seed)
    until = minutes * 60
    reports: dict[int, list[tuple[float, float]]] = {}
    for rank in range(ranks):
        kept = []
        cold = rng.uniform(2.5, 3.5)
        for at, value in _beats(rng, step_s, 1.0, 0.0, until):
            if 20 < at % 300 < 40:
                continue  # evaluating: no step finished
            if at < 60:
                value *= cold
            if rank == 0 and int(at) % 60 < 2:
                value += 3.0 * step_s / BEAT_S  # a 3 s save inside one step, in this beat's mean
            kept.append((at, value))
        reports[rank] = kept
    return _run(reports, until)[1]


def cost(steps_per_second: float, ranks: int = 3) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "progress.jsonl")
        beat = Heartbeat(path)
        beat.phase("training")
        n = 20000
        began = time.process_time()
        for step in range(n):
            beat.step(step)
        plain_step = (time.process_time() - began) / n
        began = time.process_time()
        for step in range(n):
            beat.step(step, compute_s=0.01)
        compute_step = (time.process_time() - began) / n
        beats = 2000
        with_compute = {"kind": "heartbeat", "phase": "training", "time": 1.0, "step": 5, "idle_s": 0.1,
                        "compute_s": 0.0123, "compute_steps": 40}
        plain = {k: v for k, v in with_compute.items() if not k.startswith("compute")}
        began = time.process_time()
        for _ in range(beats):
            beat.step(1, compute_s=0.01)
            beat.beat()
        beat_with = (time.process_time() - began) / beats
        began = time.process_time()
        for _ in range(beats):
            read_heartbeat(with_compute)
        read_with = (time.process_time() - began) / beats
        began = time.process_time()
        for _ in range(beats):
            read_heartbeat(plain)
        read_plain = (time.process_time() - began) / beats
    detector = StragglerDetector()
    for i in range(200):
        for rank in range(ranks):
            detector.add(rank, i * POLL_S, 0.05)
    began = time.process_time()
    for i in range(2000):
        detector.evaluate(400.0 + i * 0.001)
    evaluate = (time.process_time() - began) / 2000
    # Per node (one rank per node): the rank's extra per step, the beat's two fields (the beat's
    # whole cost is an upper bound), the head's read and evaluation (the head's share per node).
    per_node = ((compute_step - plain_step) * steps_per_second + beat_with / BEAT_S
                + (read_with - read_plain) / BEAT_S + evaluate / POLL_S / ranks)
    return {"step_plain_us": plain_step * 1e6, "step_compute_us": compute_step * 1e6, "beat_us": beat_with * 1e6,
            "read_extra_us": (read_with - read_plain) * 1e6, "evaluate_us": evaluate * 1e6,
            "per_node_percent": per_node * 100}


def sample_cost() -> float:
    """CPU seconds of one rank_signals sample, its sleep left out (a real process as the rank)."""
    rank = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"], start_new_session=True)
    try:
        with tempfile.TemporaryDirectory() as root:
            directory = Path(rank_signals.rank_dir(root, "job", 0, 0))
            directory.mkdir(parents=True)
            (directory / "pid").write_text(str(rank.pid))
            began = time.process_time()
            rank_signals.rank_signals(root, "job", 0, 0, seconds=1.0)
            return time.process_time() - began
    finally:
        rank.kill()
        rank.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--steps-per-second", type=float, default=20.0)
    args = parser.parse_args()
    for step_s in (0.05, 12.0):
        delays = [d for seed in range(args.seeds) if (d := detection_delay(seed, step_s)) is not None]
        missed = args.seeds - len(delays)
        q = statistics.quantiles(delays, n=100) if len(delays) > 1 else [float("nan")] * 99
        bound = max(30.0, 20 * step_s)
        print(f"detection, steps of {step_s:g} s: p50 {q[49]:.1f} s, p95 {q[94]:.1f} s, max {max(delays):.1f} s, "
              f"missed {missed} of {args.seeds}; bound {bound:g} s")
    falses = [false_stragglers(seed) for seed in range(max(1, args.seeds // 10))]
    print(f"false stragglers over 30 minutes with checkpoints, evaluations and a first epoch: {sum(falses)} "
          f"in {len(falses)} runs")
    found = cost(args.steps_per_second)
    print("cost: " + ", ".join(f"{k} {v:.3f}" for k, v in found.items()) + f" (at {args.steps_per_second:g} steps/s)")
    print(f"one rank_signals sample (once per straggler named): {sample_cost() * 1000:.1f} ms of CPU")


if __name__ == "__main__":
    main()
