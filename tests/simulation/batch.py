"""The fault schedules as a batch: seeds split over worker processes, broken invariants collected.

``python -m tests.simulation.batch --first 0 --count 10000 --out RESULT.json`` runs them and
writes ``{"count", "seconds", "workers", "broken"}``. The suite starts it in the background at
the lowest priority as soon as the schedules test is collected (tests/conftest.py): it then uses
only the cycles the real-process tests leave idle (waiting on ranks, timeouts and backoffs), and
the test reads its result; run alone, the test runs the batch itself."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time

from tests.simulation.schedules import InvariantBroken, run_schedule


def _run_seeds(seeds: range) -> list[str]:
    broken = []
    for seed in seeds:
        try:
            run_schedule(seed)
        except InvariantBroken as exc:
            broken.append(str(exc))
    return broken


def run_batch(first: int, count: int) -> dict[str, object]:
    workers = max(1, min(4, os.cpu_count() or 1))
    step = -(-count // workers)
    chunks = [range(first + i, min(first + count, first + i + step)) for i in range(0, count, step)]
    started = time.monotonic()
    if workers == 1:
        results = [_run_seeds(chunk) for chunk in chunks]
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            results = pool.map(_run_seeds, chunks)
    return {"count": count, "seconds": round(time.monotonic() - started, 1), "workers": workers,
            "broken": [failure for result in results for failure in result]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests.simulation.batch")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=10000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    result = run_batch(args.first, args.count)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
