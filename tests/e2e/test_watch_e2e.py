"""Watching a real emulated run: scrape /metrics and open the status page in headless Chromium meanwhile.

One `coordinator emulate` (three agents, one per device class, over a managed mosquitto) serves both
endpoints for the whole module; it is stopped with Ctrl-C at the end, after which both ports must be
closed and no process of the run left.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from coordinator.transport.broker.base import free_port
from coordinator.transport.broker.mosquitto import find_mosquitto
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
DEMO = ROOT / "examples" / "demo.yaml"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT_S = 240

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]


@dataclass
class WatchedEmulation:
    process: subprocess.Popen[str]
    run_dir: Path
    metrics_url: str
    page_url: str
    devices: list[str]

    def rounds(self) -> list[dict]:
        return [json.loads(line) for line in (self.run_dir / "metrics.jsonl").read_text().splitlines()]


def _printed(output: Path, process: subprocess.Popen[str], prefix: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for line in output.read_text().splitlines():
            if line.startswith(prefix):
                return line.removeprefix(prefix).strip()
        assert process.poll() is None, output.read_text()[-3000:]
        time.sleep(0.2)
    raise AssertionError(f"{prefix!r} never printed")


def _closed(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=5)
    except urllib.error.URLError as error:
        return isinstance(error.reason, ConnectionRefusedError)
    return False


@pytest.fixture(scope="module")
def emulation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WatchedEmulation]:
    tmp = tmp_path_factory.mktemp("watched-emulation")
    fleet = yaml.safe_load(DEMO.read_text())
    fleet["transport"]["broker"]["port"] = free_port()
    fleet.update(rounds=100, devices=fleet["devices"][::3])  # one device of each class; stopped long before
    (tmp / "fleet.yaml").write_text(yaml.safe_dump(fleet, sort_keys=False))
    run_dir = tmp / "run"
    command = [sys.executable, "-m", "coordinator", "emulate", "--fleet", str(tmp / "fleet.yaml"), "--no-live"]
    command += ["--run-dir", str(run_dir), "--metrics-port", "0", "--status-port", "0"]
    output = tmp / "coordinator.out"
    with output.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        watched = WatchedEmulation(
            process,
            run_dir,
            _printed(output, process, "metrics:"),
            _printed(output, process, "status page:"),
            [d["id"] for d in fleet["devices"]],
        )
        yield watched
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=90) == 0, output.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "Traceback" not in output.read_text()
    assert _closed(watched.metrics_url) and _closed(watched.page_url), "a server outlived the run"
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    assert leftovers == [], "processes of the run left behind"


def _scrape(url: str) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples
    }


def test_a_scrape_during_the_run_agrees_with_metrics_jsonl(emulation: WatchedEmulation) -> None:
    deadline = time.monotonic() + WAIT_S
    samples = _scrape(emulation.metrics_url)
    while samples.get(("fedfleet_rounds_completed_total", frozenset()), 0) < 2:
        assert time.monotonic() < deadline and emulation.process.poll() is None, "two rounds never closed"
        time.sleep(0.5)
        samples = _scrape(emulation.metrics_url)
    completed = int(samples[("fedfleet_rounds_completed_total", frozenset())])
    rounds = emulation.rounds()[:completed]  # the file may already hold a later round than the scrape
    assert [r["round"] for r in rounds] == list(range(1, completed + 1))
    last = rounds[-1]
    plain: frozenset = frozenset()
    assert samples[("fedfleet_round_last_completed", plain)] == last["round"]
    assert samples[("fedfleet_round_accuracy_ratio", plain)] == pytest.approx(last["accuracy"])
    assert samples[("fedfleet_round_loss", plain)] == pytest.approx(last["loss"])
    assert samples[("fedfleet_round_participants", plain)] == last["participants"] == len(emulation.devices)
    assert samples[("fedfleet_round_duration_seconds", plain)] == pytest.approx(last["seconds"])
    assert samples[("fedfleet_round_stragglers", plain)] == 0
    for phase, seconds in last["phases"].items():
        assert samples[("fedfleet_round_phase_seconds", frozenset({"phase": phase}.items()))] == pytest.approx(seconds)
    classes: dict[str, float] = {}
    for device in emulation.devices:
        rows = [r["devices"][device] for r in rounds]
        labels = {"device": device, "device_class": rows[-1]["device_class"]}

        def value(name: str, labels: dict[str, str] = labels) -> float:
            return samples[(name, frozenset(labels.items()))]

        assert value("fedfleet_device_upload_bytes_total") == sum(r["bytes_up"] for r in rows)
        assert value("fedfleet_device_download_bytes_total") == sum(r["bytes_down"] for r in rows)
        assert value("fedfleet_device_train_seconds_total") == pytest.approx(sum(r["train_seconds"] for r in rows))
        assert value("fedfleet_device_host_train_seconds_total") == pytest.approx(sum(r["host_seconds"] for r in rows))
        assert value("fedfleet_device_uploads_accepted_total") == completed
        assert value("fedfleet_device_oom_step_downs_total") == 0
        assert value("fedfleet_device_online") == 1
        assert value("fedfleet_device_rank_ratio") == rows[-1]["ratio"]
        classes[labels["device_class"]] = sum(r["bytes_up"] for r in rows)
    for device_class, bytes_up in classes.items():
        key = ("fedfleet_class_upload_bytes_total", frozenset({"device_class": device_class}.items()))
        assert samples[key] == bytes_up
    assert len(set(classes)) == 3


@pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)",
)
def test_the_status_page_shows_the_fleet_and_draws_the_accuracy_chart(
    emulation: WatchedEmulation, tmp_path: Path
) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    try:
        driver.get(emulation.page_url)

        def ready(driver: webdriver.Chrome) -> bool:
            rows = driver.find_elements(By.CSS_SELECTOR, "#fleet tbody tr[data-device]")
            finished = [r for r in rows if r.find_element(By.CSS_SELECTOR, ".last-round").text != "-"]
            lines = driver.find_elements(By.CSS_SELECTOR, "#accuracy-chart path.line.accuracy")
            return (
                len(finished) == len(emulation.devices)
                and bool(lines)
                and int(lines[0].get_attribute("data-points")) >= 2
            )

        WebDriverWait(driver, WAIT_S, poll_frequency=0.5).until(ready)
        shown = [row.get_attribute("data-device") for row in driver.find_elements(By.CSS_SELECTOR, "#fleet tbody tr")]
        assert shown == emulation.devices
        path = driver.find_element(By.CSS_SELECTOR, "#accuracy-chart path.line.accuracy").get_attribute("d")
        points = re.findall(r"[ML]([\d.]+) ([\d.]+)", path)
        assert len(points) >= 2 and all(0 <= float(x) <= 480 and 0 <= float(y) <= 220 for x, y in points)
        assert "rounds done" in driver.find_element(By.ID, "summary").text
        screenshot = tmp_path / "status-page.png"
        assert driver.save_screenshot(str(screenshot))
        assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000
        if os.environ.get("FEDFLEET_STATUS_SCREENSHOT"):
            shutil.copyfile(screenshot, os.environ["FEDFLEET_STATUS_SCREENSHOT"])
    finally:
        driver.quit()
