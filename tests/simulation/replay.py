"""``python -m tests.simulation.replay SEED [SEED...]``: run fault schedules again and print what happened."""

from __future__ import annotations

import sys

from tests.simulation.schedules import InvariantBroken, make_schedule, run_schedule


def main(argv: list[str]) -> int:
    status = 0
    for seed in (int(a) for a in argv):
        schedule = make_schedule(seed)
        try:
            result = run_schedule(schedule)
        except InvariantBroken as exc:
            print(f"seed {seed}: BROKEN\n{exc}")
            status = 1
            continue
        print(schedule.describe())
        for request in result["requests"]:
            if request.kind != "submit":
                print(f"  {request.describe()}: {request.answer} at t={request.answered_at:g}")
        for run in result["runs"]:
            record = run["record"]
            line = result["timeline"].get(run["run_id"], [])
            print(f"  run {run['run_id']}: {run['state']} at step {record.get('step')} after "
                  f"{record.get('attempt', -1) + 1} attempts, {record.get('restarts')} restarts"
                  + (f"; {record['error']}" if record.get("error") else "")
                  + ("\n    " + " → ".join(f"{state} {t:.2f}" for t, state in line) if line else ""))
        if result["incarnations"] > 1:
            print(f"  the daemon ran {result['incarnations']} times")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["0"]))
