"""The ``fedfleet_*`` families: conventional names, bounded labels, values equal to the run's records."""

from __future__ import annotations

import json
import re
from dataclasses import replace

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from coordinator.observe.prometheus import RunCollector
from coordinator.observe.snapshot import FleetWatch
from tests.coordinator.observe.conftest import ROUNDS, WatchedRun
from tests.paths import REPO_ROOT

ROOT = REPO_ROOT
LABELS = {"device", "device_class", "rank_ratio", "reason", "phase", "status"}


def scrape(watch: FleetWatch) -> dict[tuple[str, frozenset], float]:
    registry = CollectorRegistry()
    registry.register(RunCollector(lambda: watch.snapshot))
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_names_follow_prometheus_conventions_and_labels_stay_bounded(watched_run: WatchedRun) -> None:
    samples = scrape(watched_run.watch)
    names = {name for name, _ in samples}
    assert all(re.fullmatch(r"fedfleet_[a-z_]+", name) for name in names), names
    counters = {name for name in names if name.endswith("_total")}
    assert "fedfleet_device_upload_bytes_total" in counters and "fedfleet_device_train_seconds_total" in counters
    assert all(not name.endswith("_created") for name in names)  # no timestamps posing as series
    assert set().union(*(dict(labels).keys() for _, labels in samples)) <= LABELS


def test_values_match_metrics_jsonl(watched_run: WatchedRun) -> None:
    samples = scrape(watched_run.watch)
    rounds = watched_run.metrics

    def device(name: str, device_id: str) -> float:
        return samples[(name, frozenset({"device": device_id, "device_class": "simulated"}.items()))]

    for device_id in ("bad", "good"):
        rows = [m.devices[device_id] for m in rounds]
        assert device("fedfleet_device_upload_bytes_total", device_id) == sum(r.bytes_up for r in rows)
        assert device("fedfleet_device_download_bytes_total", device_id) == sum(r.bytes_down for r in rows)
        assert device("fedfleet_device_uploads_accepted_total", device_id) == sum(r.status == "accepted" for r in rows)
        assert device("fedfleet_device_rounds_selected_total", device_id) == len(rows)
        assert device("fedfleet_device_uploads_clipped_total", device_id) == sum(r.clipped is not None for r in rows)
        assert device("fedfleet_device_online", device_id) == 1.0
    assert device("fedfleet_device_rank_ratio", "good") == 0.5
    refused = {"device": "bad", "device_class": "simulated", "reason": "bad_meta"}
    assert samples[("fedfleet_device_uploads_refused_total", frozenset(refused.items()))] == ROUNDS
    by_class = frozenset({"device_class": "simulated"}.items())
    assert samples[("fedfleet_class_upload_bytes_total", by_class)] == sum(m.bytes_up for m in rounds)
    assert samples[("fedfleet_class_devices_online", by_class)] == 2
    for level in ("1", "1/2"):  # bad at 1, good at 1/2
        assert samples[("fedfleet_class_devices_at_rank_ratio", by_class | {("rank_ratio", level)})] == 1
    last = rounds[-1]
    plain = frozenset()
    assert samples[("fedfleet_rounds_completed_total", plain)] == ROUNDS
    assert samples[("fedfleet_round_accuracy_ratio", plain)] == last.accuracy
    assert samples[("fedfleet_round_loss", plain)] == last.loss
    assert samples[("fedfleet_round_federated_accuracy_ratio", plain)] == last.federated_accuracy
    assert samples[("fedfleet_round_federated_loss", plain)] == last.federated_loss
    assert samples[("fedfleet_round_participants", plain)] == last.participants == 1
    assert samples[("fedfleet_round_duration_seconds", plain)] == last.seconds
    for phase, seconds in last.phases.items():
        assert samples[("fedfleet_round_phase_seconds", frozenset({"phase": phase}.items()))] == seconds


def test_nothing_is_exported_before_the_engine_first_reports() -> None:
    assert scrape(FleetWatch([])) == {}


def test_the_grafana_example_is_valid_json_and_queries_only_exported_metrics(watched_run: WatchedRun) -> None:
    dashboard = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    registry = CollectorRegistry()
    registry.register(RunCollector(lambda: watched_run.watch.snapshot))
    exported = set(re.findall(r"^# HELP (\S+)", generate_latest(registry).decode(), re.MULTILINE))
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"fedfleet_[a-z_]+", target["expr"])
    }
    assert len(dashboard["panels"]) >= 10 and queried
    assert queried <= exported, queried - exported


def test_a_private_run_exports_its_epsilon(watched_run: WatchedRun) -> None:
    snapshot = watched_run.watch.snapshot
    assert snapshot is not None
    assert not any(name == "fedfleet_privacy_epsilon" for name, _ in scrape(watched_run.watch))
    last = replace(snapshot.history[-1], epsilon=2.5, delta=1e-5)
    private = replace(snapshot, history=[*snapshot.history[:-1], last])
    registry = CollectorRegistry()
    registry.register(RunCollector(lambda: private))
    text = generate_latest(registry).decode()
    assert "fedfleet_privacy_epsilon 2.5" in text
