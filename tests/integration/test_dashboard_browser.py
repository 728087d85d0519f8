"""The dashboard in a real browser during a real local job: a broker and actors (two trainer ranks, two hybrid
rollout slots, a tool slot and an episode runner), ``libra dashboard`` as its own process, and Debian's chromium
driven by Playwright. The tiny job runs with the Elastic Hybrid Pool forced to borrow a hybrid slot for training
at step 1 and give it back at step 3: the broker switches that slot's role, and the page must show the switch in
its timeline, then the job's four steps in its curves.

``LIBRA_DASHBOARD_SCREENSHOT=docs/dashboard.png`` also saves the page there (after a 16-step job of 6 prompts a step with two borrows:
how ``docs/dashboard.png`` was made); the test always saves one in its temporary directory."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from libra.lifetime import die_with_parent
from libra.local import LocalCluster, stop_process
from libra.rl.config import load_job
from libra.rl.driver import resolve_model, run_job

CHROMIUM = "/usr/bin/chromium"
pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                 reason=f"no browser at {CHROMIUM}: sudo apt-get install chromium (.ci/run does)"),
              pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: sudo apt-get install bubblewrap")]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "arith_tiny.toml"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 240_000  # generous: the job's processes share two cores with everything else


def broker_toml(force: list[list[int]]) -> str:
    return f"""
[broker]
heartbeat_s = 2.0
router = "cmlfq"
action_scheduler = "tangram"

[broker.planner]
allocation = "grp_ehp"
hardware = "cpu"
model = "tiny"
group_size = 4
batch = 8
interval_s = 3600

[broker.planner.ehp]
force = {json.dumps(force)}
"""


def start_dashboard(url: str) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "libra.dashboard", "--broker", url, "--port", "0"],
                         stdout=subprocess.PIPE, text=True, preexec_fn=die_with_parent())
    assert p.stdout is not None
    line = p.stdout.readline()
    assert line.startswith("libra dashboard: http://"), line
    return p, line.split()[2]


def run_in_thread(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def body() -> None:
        try:
            out["summary"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            out["error"] = exc

    t = threading.Thread(target=body, name="job", daemon=True)
    t.start()
    return t, out


@pytest.mark.timeout(900)
def test_the_page_shows_a_role_switch_and_the_job_curves_during_a_real_job(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    shot = os.environ.get("LIBRA_DASHBOARD_SCREENSHOT")
    steps, prompts, force = (16, 6, [[2, 1], [6, 0], [10, 1], [14, 0]]) if shot else (4, 2, [[1, 1], [3, 0]])
    cfg = load_job(EXAMPLE).with_run_dir(str(tmp_path / "run"))
    cfg = dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, steps=steps, prompts_per_step=prompts),
                              actors=dataclasses.replace(cfg.actors, allow_unisolated=False))
    (tmp_path / "broker.toml").write_text(broker_toml(force))
    actor_args = ["--roles", "train=2,hybrid=2,action=1,episode=1", "--model-dir", str(resolve_model(cfg.model.name)),
                  "--run-dir", cfg.job.run_dir, "--torch-threads", "1", "--rollout-batch", "4", "--no-restart"]
    cluster = LocalCluster(cpu_slots=6, actor_args=actor_args, env={"OMP_NUM_THREADS": "1"},
                           broker_args=["--config", str(tmp_path / "broker.toml")])
    cluster.start(wait_actors=6, timeout=300.0)
    dash, page_url = start_dashboard(cluster.url)
    errors: list[str] = []
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(page_url)
            page.wait_for_selector("body[data-polls]", timeout=WAIT_MS)  # the first view arrived over SSE
            job, out = run_in_thread(lambda: run_job(cfg, cluster.url, progress=False))
            entry = page.wait_for_selector('#timeline .tl-entry[data-switch="1"]', timeout=WAIT_MS)
            assert entry is not None
            text = entry.inner_text()
            assert " -> " in text and "role switch" in text and "by ehp" in text, text
            actor = entry.get_attribute("data-actor")
            assert actor and actor.split("/")[-1] in ("cpu2", "cpu3"), actor  # one of the two hybrid slots
            job.join(WAIT_MS / 1000)
            assert not job.is_alive() and "error" not in out, out.get("error")
            expect(page.locator("#jobs .job h3")).to_contain_text(f"step {steps}/{steps}", timeout=WAIT_MS)
            expect(page.locator("#jobs .job .uplot")).to_have_count(2)
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            if shot:
                page.screenshot(path=shot, full_page=True)
            browser.close()
        view = json.load(urllib.request.urlopen(page_url + "api/status", timeout=10))
    finally:
        stop_process(dash)
        if dash.stdout is not None:
            dash.stdout.close()
        cluster.stop()
    assert not errors, errors  # the page's script ran without an error
    switches = [e for e in view["timeline"] if e["switch"]]
    assert {e["by"] for e in switches} == {"ehp"} and len(switches) == len(force)  # each forced move once
    assert view["jobs"]["arith_tiny"]["step"] == list(range(1, steps + 1))
    assert all(isinstance(r, float) for r in view["jobs"]["arith_tiny"]["reward_mean"])
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
