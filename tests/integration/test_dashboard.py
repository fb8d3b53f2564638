"""The lighthouse's status page in a real headless Chromium while real groups train, one is SIGKILLed and restarted:
what a person watching sees (the death in the event log, the quorum shrinking and growing back, the catch-up).

Chromium comes from the distribution's packages (``scripts/install_browser.sh``, run by .ci/run). Without it the
test is skipped, saying why, unless ``FTHSDP_REQUIRE_BROWSER=1`` (CI) makes that a failure. The screenshots are
written to the test's own tmp folder (``dashboard-kill.png``, ``dashboard-recovered.png``; the paths are printed).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lightning_fthsdp.launch.processes import Group, Job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

STEPS = 100_000  # train until the test ends them: the page is watched while the job runs
BROWSERS = ("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def chromium() -> str:
    path = next((p for p in map(shutil.which, BROWSERS) if p), None)
    if path is None:
        reason = (f"no headless browser ({', '.join(BROWSERS)}) on PATH: run scripts/install_browser.sh (Debian's "
                  f"chromium package) to run this test")
        if os.environ.get("FTHSDP_REQUIRE_BROWSER") == "1":
            pytest.fail(reason)
        print(reason)
        pytest.skip(reason)
    return path


class Browser:
    """Headless Chromium loading the page as a person with the token would: HTTP Basic, the token as password."""

    def __init__(self, executable: str, job: Job, profile: Path) -> None:
        self._executable, self._profile = executable, profile
        assert job.token, "the dashboard is tested with a token, as a job runs"
        self.url = job.lighthouse_url.replace("http://", f"http://viewer:{job.token}@", 1) + "/"

    def _run(self, *args: str) -> str:
        # --virtual-time-budget: the page's first polls of /status and /events complete before the DOM is taken.
        cmd = [self._executable, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
               f"--user-data-dir={self._profile}", "--virtual-time-budget=4000", "--window-size=1280,1700", *args,
               self.url]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=90, check=False)
        assert done.returncode == 0, f"{cmd[0]} exited {done.returncode}: {done.stderr[-2000:]}"
        return done.stdout

    def dom(self) -> Page:
        return Page(self._run("--dump-dom"))

    def screenshot(self, path: Path) -> None:
        self._run(f"--screenshot={path}")
        assert path.stat().st_size > 10_000, f"{path} is {path.stat().st_size} bytes: not a rendered page"
        print(f"dashboard screenshot: {path}")


class Page(HTMLParser):
    """The rendered DOM: every element with an id or a data- attribute, in document order, with its attributes, its
    text, and the ids of the elements it is inside."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[tuple[dict[str, str], list[str], tuple[str, ...]]] = []
        self._open: list[tuple[str, dict[str, str], list[str]]] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = {k: v or "" for k, v in attrs}
        inside = tuple(a["id"] for _, a, _ in self._open if "id" in a)
        entry = (tag, values, [])
        if tag not in ("meta", "link", "br", "img", "input"):  # void elements have no end tag
            self._open.append(entry)
        if "id" in values or any(k.startswith("data-") for k in values):
            self.elements.append((values, entry[2], inside))

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            if self._open.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        for _, _, text in self._open:
            text.append(data)

    def text(self, element_id: str) -> str:
        return next("".join(t) for attrs, t, _ in self.elements if attrs.get("id") == element_id)

    def rows(self, inside: str, **data: str) -> list[dict[str, str]]:
        """The attributes (and ``text``) of the elements inside the element ``inside`` whose data- attributes include
        ``data`` (``kind="death"`` matches ``data-kind="death"``), in document order."""
        return [attrs | {"text": "".join(t)} for attrs, t, ids in self.elements
                if inside in ids and all(attrs.get(f"data-{k}") == v for k, v in data.items())]


def status_of(job: Job, replica_id: str) -> dict[str, object]:
    return next((g for g in job.status()["groups"] if g["replica_id"] == replica_id), {})


def test_dashboard_shows_a_kill_and_the_recovery(job: Job, chromium: str, tmp_path: Path) -> None:
    job.start_lighthouse()
    browser = Browser(chromium, job, tmp_path / "chromium-profile")
    groups = {rid: job.start_group(rid, STEPS) for rid in ("a", "b", "c")}
    wait_for(lambda: len(job.status()["members"]) == 3 and job.status()["committed_step"] >= 5, 60,
             "a quorum of a, b and c at step 5")

    victim: Group = groups["c"]
    os.killpg(victim.proc.pid, signal.SIGKILL)
    assert job.wait_exit(victim, 10) == -signal.SIGKILL
    wait_for(lambda: job.status()["members"] == ["a", "b"] and status_of(job, "c").get("state") == "down", 30,
             "the quorum without c, and c down")
    page = browser.dom()
    browser.screenshot(tmp_path / "dashboard-kill.png")
    assert page.text("quorum-size") == "2" and page.text("members") == "a, b"
    assert [row["data-state"] for row in page.rows("groups", replica="c")] == ["down"]
    deaths = [row["text"] for row in page.rows("events", kind="death", replica="c")]
    assert len(deaths) == 1 and "c died at step" in deaths[0] and "crash" in deaths[0], deaths

    job.start_group("c", STEPS)
    wait_for(lambda: status_of(job, "c").get("state") == "training" and len(job.status()["members"]) == 3, 60,
             "c training again in a quorum of three")
    page = browser.dom()
    browser.screenshot(tmp_path / "dashboard-recovered.png")
    assert page.text("quorum-size") == "3" and page.text("members") == "a, b, c"
    (c_row,) = page.rows("groups", replica="c")
    assert (c_row["data-state"], c_row["data-incarnations"]) == ("training", "2"), c_row
    assert "1 (last: crash)" in c_row["text"], c_row
    events = [(row["data-kind"], row["data-replica"], row["text"]) for row in page.rows("events")][::-1]  # oldest 1st
    kinds = [(kind, rid) for kind, rid, _ in events]
    after_death = kinds[kinds.index(("death", "c")):]
    assert {("rejoin", "c"), ("catch_up", "c"), ("caught_up", "c"), ("recovered", "c")} <= set(after_death), events
    # c's leader reported its catch-up: the source, the bytes and the time.
    fetched = [text for kind, rid, text in events[kinds.index(("death", "c")):] if (kind, rid) == ("fetched", "c")]
    report = r"c fetched [\d.]+ (B|KiB|MiB) of the state of step \d+ from [ab] in [\d.]+ s"
    assert len(fetched) == 1 and re.search(report + "$", fetched[0]), fetched  # the row: time, kind, text
    quorums = [text for kind, _, text in events[kinds.index(("death", "c")):] if kind == "quorum"]
    assert any("2 members (a, b); -c" in q for q in quorums) and "3 members (a, b, c); +c" in quorums[-1], quorums
    # The membership history, oldest first: c a member, then not (the kill), then a member again (it may have joined
    # the first quorum late: a "no" before the first "yes").
    c_history = [row["data-member"] for row in page.rows("timeline", replica="c") if "data-member" in row]
    changes = [m for i, m in enumerate(c_history) if i == 0 or m != c_history[i - 1]]
    assert changes[-3:] == ["yes", "no", "yes"], c_history
    for figure in ("stalls", "recoveries", "catch_ups"):
        (row,) = page.rows("figures", figure=figure)
        assert int(row["data-count"]) >= 1, f"no {figure} shown: {row}"

    # What Prometheus scrapes says the same.
    request = urllib.request.Request(f"{job.lighthouse_url}/metrics", headers=job.auth_headers())
    with urllib.request.urlopen(request, timeout=10) as response:
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(response.read().decode()) for s in family.samples}
    assert samples[("fthsdp_failures_total", (("kind", "crash"),))] == 1
    assert samples[("fthsdp_recovery_seconds_count", ())] == 1 and samples[("fthsdp_stall_seconds_count", ())] == 1
    assert samples[("fthsdp_quorum_size", ())] == 3 and samples[("fthsdp_step_rate", ())] > 0
