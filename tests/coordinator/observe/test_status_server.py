"""The status page server: token-guarded, read-only, self-contained (no CDN), JSON snapshot for scripts."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

from coordinator.observe.snapshot import FleetWatch
from coordinator.observe.status_server import StatusServer
from device_agent.wire.messages import incompatible
from tests.coordinator.observe.conftest import WatchedRun
from tests.coordinator.rounds.test_engine_diagnostics import idle_engine
from tests.e2e.test_watch_e2e import CHROMEDRIVER, CHROMIUM


@pytest.fixture
def server(watched_run: WatchedRun) -> Iterator[StatusServer]:
    server = StatusServer("127.0.0.1", 0, lambda: watched_run.watch.snapshot)
    yield server
    server.stop()


def fetch(url: str, method: str = "GET") -> tuple[int, bytes, dict[str, str]]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as answer:
            return answer.status, answer.read(), dict(answer.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read(), dict(error.headers)


def test_the_json_snapshot_needs_the_token_printed_at_start(server: StatusServer, watched_run: WatchedRun) -> None:
    status, body, headers = fetch(server.url(f"/api/status?token={server.token}"))
    assert status == 200 and headers["Content-Type"] == "application/json"
    snapshot = json.loads(body)
    assert [d["id"] for d in snapshot["devices"]] == ["bad", "good"]
    assert [r["accuracy"] for r in snapshot["history"]] == [m.accuracy for m in watched_run.metrics]
    assert snapshot["refusals"][0]["reason"] == "bad_meta"
    for url in ("/api/status", "/api/status?token=wrong", "/"):
        status, body, _ = fetch(server.url(url))
        assert status == 403 and b"the URL the coordinator printed" in body
    assert fetch(server.page_url)[0] == 200


def test_nothing_can_be_changed_through_it(server: StatusServer) -> None:
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        status, _, headers = fetch(server.url(f"/api/status?token={server.token}"), method)
        assert (status, headers["Allow"]) == (405, "GET, HEAD")


def test_the_page_loads_nothing_from_outside(server: StatusServer) -> None:
    status, page, headers = fetch(server.page_url)
    assert status == 200 and "default-src 'self'" in headers["Content-Security-Policy"]
    for asset in re.findall(rb'(?:src|href)="([^"]+)"', page):
        assert fetch(server.url("/" + asset.decode()))[0] == 200
    static = resources.files("coordinator.observe").joinpath("static")
    for item in static.iterdir():
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", item.read_text()), item.name


def test_stop_frees_the_port(watched_run: WatchedRun) -> None:
    server = StatusServer("127.0.0.1", 0, lambda: watched_run.watch.snapshot)
    port = server.address[1]
    server.stop()
    again = StatusServer("127.0.0.1", port, lambda: None)  # the port is free again at once
    status, body, _ = fetch(again.url(f"/api/status?token={again.token}"))
    again.stop()
    assert (status, json.loads(body)) == (200, {"waiting": True})


@pytest.mark.slow
@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)",
)
def test_a_device_of_another_protocol_version_shows_as_refused_with_why(tmp_path: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    engine = idle_engine(tmp_path, wait_timeout_s=1)
    watch = FleetWatch([])
    engine._on_message("laptop-01", incompatible(4))
    watch.update(engine)
    server = StatusServer("127.0.0.1", 0, lambda: watch.snapshot)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(server.page_url)
        row = '#fleet tbody tr[data-device="laptop-01"] td'
        WebDriverWait(driver, 30, poll_frequency=0.2).until(lambda d: d.find_elements(By.CSS_SELECTOR, row))
        cells = driver.find_elements(By.CSS_SELECTOR, row)
        assert (cells[2].text, cells[2].get_attribute("class")) == ("refused", "refused")
        assert cells[3].text == incompatible(4).detail
        assert "0/1 devices online, 1 refused" in driver.find_element(By.ID, "summary").text
        for chart in ("accuracy-chart", "bytes-chart"):  # before round 1: no scale made up from nothing
            labels = [t.text for t in driver.find_elements(By.CSS_SELECTOR, f"#{chart} text")]
            assert sorted(labels) == ["1", "2", "no round closed yet"], labels
    finally:
        driver.quit()
        server.stop()
        engine.rundir.close()
