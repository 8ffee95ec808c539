"""The dashboard of a real local daemon: what it serves, to whom, and what headless Chromium
draws of it after a real run with a killed rank; and what it draws of a run's checkpoint store,
from a document of the real shape served by the real web server."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import anyio.from_thread
import pytest

from coordinator.config.cluster_file import DashboardSettings
from coordinator.jobs.record import Durability, JobRecord
from coordinator.jobs.run_context import RunContext
from coordinator.jobs.spec import JobSpec
from coordinator.jobs.view import run_view
from coordinator.observe.dashboard.document import dashboard_document
from coordinator.observe.web.routes import api_routes, page_routes
from coordinator.observe.web.server import WebServer
from tests.integration.daemon_harness import DaemonProcess, all_up, coord, environment, short_tempdir
from tests.integration.test_jobs_local import PLAIN

TOKEN = "dashboard-test-token-0123456789"

CLUSTER = """\
[cluster]
name = "dash-local"
state_dir = "{root}/state"

[ssh]
keepalive_s = 0.5

[dashboard]
listen = "127.0.0.1:0"
token = "{token}"

[[nodes]]
name = "alpha-node"
host = "local"
workdir = "{root}/a"

[[nodes]]
name = "beta-node"
host = "local"
workdir = "{root}/b"
"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.fixture(scope="module")
def dashboard():
    root = short_tempdir()
    (root / "project").mkdir()
    (root / "project" / "plain.py").write_text(PLAIN)
    config = root / "cluster.toml"
    config.write_text(CLUSTER.format(root=root, token=TOKEN))
    daemon = DaemonProcess(config, env=environment()).start()
    doc = daemon.wait_for(all_up, 30, "all nodes up")
    url = (doc.get("dashboard") or {}).get("url")
    assert url and url.startswith("http://127.0.0.1:"), doc.get("dashboard")
    yield daemon, root, url
    daemon.stop()
    shutil.rmtree(root, ignore_errors=True)


def get(url: str, *, token: str | None = TOKEN, host: str | None = None, method: str = "GET"):
    request = urllib.request.Request(url, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    if host:
        request.add_header("Host", host)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def test_data_needs_the_token_the_page_does_not_and_nothing_but_get_is_answered(dashboard):
    _, _, url = dashboard
    status, headers, body = get(url, token=None)
    assert status == 200 and b"<title>coord</title>" in body
    assert "default-src 'self'" in headers["Content-Security-Policy"]
    assert get(url + "static/vendor/uPlot.iife.min.js", token=None)[0] == 200
    assert get(url + "api/dashboard", token=None)[0] == 401
    assert get(url + "api/dashboard", token="wrong-token-wrong-token")[0] == 401
    status, _, body = get(url + "api/dashboard")
    assert status == 200 and {n["name"] for n in json.loads(body)["nodes"]} == {"alpha-node", "beta-node"}
    assert get(url + "api/dashboard?token=" + TOKEN, token=None)[0] == 200
    status, _, body = get(url + "api/status")
    assert status == 200 and json.loads(body)["cluster"]["name"] == "dash-local"
    assert get(url + "api/dashboard", method="POST")[0] == 405
    # No path from a request reaches the disk: only the page's own files are answered.
    assert get(url + "static/../../config.py")[0] == 404
    assert get(url + "static/../../config.py", token=None)[0] == 401
    assert get(url + "nothing-here")[0] == 404
    # A page from another site whose name points at 127.0.0.1 (DNS rebinding) is refused.
    assert get(url + "api/dashboard", host="evil.example:80")[0] == 403


def _run_a_job_with_a_killed_rank(daemon: DaemonProcess, root: Path) -> dict:
    submitted = coord("run", "--config", str(daemon.config), "--name", "dash-job", "--source", str(root / "project"),
                      "--save-every", "5", "--checkpoint-store", f"file://{root}/store", "--detach", "--", "python",
                      "plain.py", "--steps", "40", "--sleep", "0.15",
                      env=daemon.env)
    assert submitted.returncode == 0, submitted.stderr
    doc = daemon.wait_for(lambda d: any(j["name"] == "dash-job" and (j["step"] >= 12 or j["state"] == "failed")
                                        for j in d["jobs"]), 300, "step 12")
    job = next(j for j in doc["jobs"] if j["name"] == "dash-job")
    assert job["state"] == "running", job
    rank_dir = root / ("a" if job["nodes"][1] == "alpha-node" else "b") / ".coord" / "jobs" / job["run_id"]
    os.kill(int((rank_dir / "attempt-0" / "rank-1" / "pid").read_text()), signal.SIGKILL)
    waited = coord("wait", "--quiet", "--json", "--config", str(daemon.config), "dash-job", env=daemon.env,
                   timeout=300)
    final = json.loads(waited.stdout)
    assert waited.returncode == 0 and final["state"] == "succeeded" and final["restarts"] == 1, final
    return final


def test_after_a_real_run_chromium_draws_the_nodes_the_job_and_its_curve(dashboard, tmp_path):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing (.ci/setup installs it)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    daemon, root, url = dashboard
    final = _run_a_job_with_a_killed_rank(daemon, root)
    status, _, body = get(url + "api/dashboard")
    doc = json.loads(body)
    job = next(j for j in doc["jobs"] if j["run_id"] == final["run_id"])
    assert job["state"] == "succeeded" and job["restarts"] == 1
    assert job["checkpoints"] and job["checkpoints"][0]["step"] == 40 and job["checkpoints"][0]["valid"]
    assert job["backend"]["backend"] == "ring"
    # Its last checkpoint went to the store before it was called succeeded.
    assert job["durability"]["durable_step"] == 40 and job["durability"]["lag_steps"] == 0, job["durability"]
    # One curve across the restart: every step once, attempt 1 from the step it resumed at.
    train = job["history"]["train"]
    assert sorted(train["step"]) == list(range(1, 41)), train["step"]
    assert [a["attempt"] for a in job["history"]["attempts"]] == [0, 1]
    page = f"{url}?token={TOKEN}"
    # A profile of its own: with the shared one, a Chromium left running elsewhere would take
    # the page over and this one would exit without drawing anything.
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1100",
            f"--user-data-dir={tmp_path / 'chromium-profile'}"]
    # Chromium's --timeout is how long the page runs before the DOM is taken: on two busy cores
    # its own start-up can eat a short one, so a page not yet drawn is given longer.
    for wait_ms in (5000, 15000, 40000):
        drawn = subprocess.run([*argv, f"--timeout={wait_ms}", "--dump-dom", page], capture_output=True, text=True,
                               timeout=180)
        dom = drawn.stdout
        if 'data-rendered="' in dom:
            break
    assert 'data-rendered="' in dom, dom[:2000] + drawn.stderr[-3000:]
    argv.append(f"--timeout={wait_ms}")
    for name in ("alpha-node", "beta-node", "dash-job", final["run_id"]):
        assert name in dom, name
    assert 'class="uplot' in dom, "no chart drawn"
    assert '<p id="curves-empty" class="muted" hidden="">' in dom, "the curve has no points"
    assert f"durable up to step 40 in file://{root}/store/{final['run_id']}, lag 0 steps" in dom, "no store line"
    shot = Path(os.environ.get("COORD_SCREENSHOT_DIR") or tmp_path) / "dashboard.png"
    subprocess.run([*argv, f"--screenshot={shot}", page], capture_output=True, timeout=120, check=True)
    assert shot.stat().st_size > 20_000


class _Effects:
    def now(self) -> float:
        return 1700000000.0

    def node_names(self) -> list[str]:
        return ["alpha-node"]


def _document_of_one_run(durability: Durability | None) -> dict:
    """The dashboard document of a cluster with one running run, its view the real one."""
    record = JobRecord(run_id="store-job-1", step=57, started=1.0, order=["alpha-node"], durability=durability)
    ctx = RunContext(_Effects(), JobSpec(name="store-job", command=["python", "train.py"]), run_id="store-job-1",
                     record=record, state="running")
    runner = SimpleNamespace(run_id=ctx.run_id, state="running", record=record, queue_position=None,
                             view=lambda: run_view(ctx, queue_position=None))
    cluster = SimpleNamespace(config=SimpleNamespace(name="dash-store"), node_views=list, events=[],
                              state=SimpleNamespace(checkpoints=lambda run_id: [], links=lambda role: {}))
    return dict(dashboard_document(cluster, [runner], now=1700000000.0))


def test_chromium_draws_how_far_a_runs_checkpoints_are_in_its_store(tmp_path):
    browser = chromium()
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing (.ci/setup installs it)")
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    served: dict = {}

    async def status() -> dict:
        return {}

    routes = api_routes(status_document=status, history=SimpleNamespace(), dashboard_document=lambda: served,
                        registry=None)
    server = WebServer(DashboardSettings(host="127.0.0.1", port=0), routes, public=frozenset(page_routes()))
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'profile'}"]

    def drawn(url: str) -> str:
        # As above: a page not yet drawn on two busy cores is given longer.
        for wait_ms in (3000, 10000, 30000):
            dom = subprocess.run([*argv, f"--timeout={wait_ms}", "--dump-dom", url], capture_output=True, text=True,
                                 timeout=120).stdout
            if 'data-rendered="' in dom:
                return dom
        raise AssertionError(dom[:2000])

    with anyio.from_thread.start_blocking_portal() as portal:
        future, url = portal.start_task(server.serve)
        try:
            served.update(_document_of_one_run(Durability(
                store="s3://bucket/coord/store-job-1", durable_step=40, lag_steps=10, lag_seconds=73.5,
                bytes_per_s=12.5e6, error="upload of part 3 timed out")))
            dom = drawn(url)
            assert ('<p id="checkpoint-store"><div>durable up to step 40 in s3://bucket/coord/store-job-1, '
                    'lag 10 steps (74 s), 12 MiB/s to the store</div>'
                    '<div class="state-down">last upload failed: upload of part 3 timed out</div></p>') in dom, dom
            served.update(_document_of_one_run(None))  # checkpoints on the cluster only: nothing said
            dom = drawn(url)
            assert "store-job-1" in dom and '<p id="checkpoint-store"></p>' in dom, dom
        finally:
            future.cancel()
