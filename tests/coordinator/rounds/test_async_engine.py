"""Async mode (FedBuff) over real in-memory agents: versions, staleness, the too-stale bound and concurrency."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from coordinator.config.fleet import parse_fleet
from coordinator.emulation.simulation import simulate, simulation_fleet
from coordinator.rounds.async_engine import AsyncEngine
from coordinator.rounds.engine import EngineSettings, RoundEngine
from coordinator.rounds.signing import UploadSignatures
from coordinator.run.rundir import RunDir
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.memory_link import HEARTBEAT_S, LocalDevice, MemoryLink, TakingTurns
from device_agent.agent.config import AgentConfig
from device_agent.agent.memory import MemoryPort
from device_agent.agent.runtime import Agent
from device_agent.clients.spec import TrainConfig
from device_agent.common.profile import DeviceProfile
from device_agent.data.datasets import LabeledData, load_dataset
from tests.coordinator.rounds.async_engines import async_engine
from tests.digit_clients import digit_clients

CNN = ModelSpec("cnn", 10, 1, 8)
NAMES = ["a", "b", "c", "d", "e", "f"]


@pytest.mark.parametrize("strategy", ["fedavg", "fedhm"])
def test_simulate_async_publishes_each_version_from_k_updates_and_learns(strategy: str, tmp_path: Path) -> None:
    data = load_dataset("digits", 8, 1)
    levels = [1.0, 1.0, 0.5, 0.5, 0.25, 0.25] if strategy == "fedhm" else None
    result = simulate(
        build_strategy(strategy, CNN, {}, seed=0),
        digit_clients(NAMES, levels),
        6,
        TrainConfig(batch_size=32),
        (data.test_x, data.test_y),
        data.train_x[:256],
        asynchronous={"buffer": 3, "max_staleness": 4},
        run_dir=tmp_path / "run",
    )

    assert [r.round for r in result.rounds] == [1, 2, 3, 4, 5, 6] and result.failed_rounds == []
    assert max(r.accuracy for r in result.rounds) > 0.6  # from 0.1 at random: the versions learn
    versions = RunDir.open(tmp_path / "run").metrics()
    for version in versions:
        assert version.asynchronous is not None and version.asynchronous.updates == 3
        assert sum(version.asynchronous.staleness.values()) == 3
        assert all(0 <= s <= 4 for s in version.asynchronous.staleness)
        assert all(row.status == "accepted" for row in version.devices.values())
    # six devices, three updates a version: an update trained while others published is stale, and weighed so
    assert any(s > 0 for version in versions for s in version.asynchronous.staleness)
    if strategy == "fedhm":  # each device trains at its own level; the update is folded at full rank
        assert {row.ratio for version in versions for row in version.devices.values()} == {1.0, 0.5, 0.25}


def test_an_update_older_than_max_staleness_is_refused_too_stale_with_the_numbers(tmp_path: Path) -> None:
    # One update makes a version: the device that trained on the version before is one behind, past the bound 0.
    engine = async_engine(tmp_path, ["a", "b", "c"], 4, {"buffer": 1, "max_staleness": 0})

    assert engine.run() is True
    assert engine.version == 4
    refused = sum(n for (_, reason), n in engine.refusals.items() if reason == "too_stale")
    assert refused >= 1 and engine.too_stale == refused
    stale = [r for r in engine.recent_refusals if r.reason == "too_stale"]
    assert stale and "versions behind the newest" in stale[0].detail and "async.max_staleness is 0" in stale[0].detail
    versions = engine.rundir.metrics()
    assert all(v.asynchronous is not None and v.asynchronous.staleness == {0: 1} for v in versions)
    assert sum(v.asynchronous.too_stale for v in versions) <= engine.too_stale  # the last refusals may come after


def test_no_more_devices_train_at_once_than_concurrency(tmp_path: Path) -> None:
    engine = async_engine(tmp_path, ["a", "b", "c", "d"], 3, {"buffer": 2, "concurrency": 2})
    most = []

    assert engine.run(lambda e: most.append(len(e.server.in_flight))) is True
    assert max(most) == 2
    assert all(v.asynchronous is not None and v.asynchronous.in_flight <= 2 for v in engine.rundir.metrics())


def test_the_round_engine_refuses_an_async_fleet_and_the_async_engine_a_sync_one(tmp_path: Path) -> None:
    clients = digit_clients(["a"])
    strategy = build_strategy("fedavg", CNN, {}, seed=0)
    (tmp_path / "fleet.yaml").write_text("fleet: x\n")
    rundir = RunDir.create(tmp_path / "run", tmp_path / "fleet.yaml", strategy.state_dict(), seed=0)
    data = load_dataset("digits", 8, 1)
    labeled = LabeledData(data.train_x, data.train_y, data.test_x, data.test_y, 10)
    link = MemoryLink([LocalDevice(c.client_id, c.train, c.test) for c in clients])
    for engine, settings in ((RoundEngine, {"buffer": 1}), (AsyncEngine, None)):
        fleet = parse_fleet(simulation_fleet(strategy, clients, 1, TrainConfig(), asynchronous=settings))
        with pytest.raises(ValueError, match=r"strategy\.mode"):
            engine(fleet, {}, strategy, rundir, labeled, link, EngineSettings(min_devices=1))
    rundir.close()


def test_the_async_engine_runs_with_the_peer_check_off_and_the_round_engine_as_configured(tmp_path: Path) -> None:
    settings = EngineSettings(min_devices=1)
    assert settings.gate.peer_min_cosine is not None  # on by default
    engine = async_engine(tmp_path, ["a"], 1, {"buffer": 1})  # the peer check judges a round at its close: none here

    assert engine.gate.settings.peer_min_cosine is None and engine.settings.gate.peer_min_cosine is None
    assert RoundEngine.settings_for(settings) is settings
    engine.rundir.close()


KEYS = {"a": bytes(range(32)), "b": bytes(range(1, 33)), "mallory": bytes(range(2, 34))}


class SigningLink(MemoryLink):
    """Agents that sign their uploads with their own key; mallory signs with a key that is not hers."""

    def agent(self, device: LocalDevice, profile: DeviceProfile, state: Path) -> Agent:
        key = bytes(32) if device.device_id == "mallory" else KEYS[device.device_id]
        key_file = state.parent / f"{device.device_id}.key"
        key_file.parent.mkdir(parents=True, exist_ok=True)
        key_file.write_text(key.hex())
        config = AgentConfig(
            device=device.device_id,
            fleet=self.fleet,
            state_dir=state,
            heartbeat_s=HEARTBEAT_S,
            signing_key=f"file:{key_file}",
        )
        hooks = TakingTurns(self.turns, device.device_id)
        return Agent(config, profile, hooks, MemoryPort(self.hub, device.device_id), device)


def test_each_update_passes_the_signature_check_and_a_forged_one_is_never_folded(tmp_path: Path) -> None:
    signatures = UploadSignatures("simulation", KEYS)
    engine = async_engine(tmp_path, ["a", "b", "mallory"], 3, {"buffer": 2}, link=SigningLink, signatures=signatures)

    assert engine.run() is True
    assert engine.refusals[("mallory", "bad_signature")] >= 1
    versions = engine.rundir.metrics()
    assert all(set(v.devices) <= {"a", "b"} for v in versions) and sum(v.asynchronous.updates for v in versions) == 6


class Restartable(MemoryLink):
    """In-memory agents one of which can leave (its port says offline) and come back as a new agent process would,
    on the same state directory."""

    def __init__(self, devices) -> None:
        super().__init__(devices)
        self.made: dict[str, tuple[Agent, DeviceProfile, Path]] = {}
        self.extra: list[threading.Thread] = []

    def agent(self, device: LocalDevice, profile: DeviceProfile, state: Path) -> Agent:
        made = super().agent(device, profile, state)
        self.made[device.device_id] = (made, profile, state)
        return made

    def leave(self, device: str) -> None:
        self.made[device][0].stop()

    def come_back(self, device: str) -> None:
        _, profile, state = self.made[device]
        agent = self.agent(self.devices[device], profile, state)
        thread = threading.Thread(target=agent.run, name=f"agent-{device}-again", daemon=True)
        self.extra.append(thread)
        thread.start()

    def stop(self) -> None:
        for agent, _, _ in self.made.values():
            agent.stop()
        for thread in self.extra:
            thread.join()
        super().stop()


def test_a_device_offline_gives_its_concurrency_slot_up_and_trains_the_newest_version_when_back(tmp_path) -> None:
    engine = async_engine(tmp_path, ["a", "b", "c"], 6, {"buffer": 2, "concurrency": 2}, link=Restartable)
    link = engine.link
    assert isinstance(link, Restartable)
    seen = {"left": None, "back": None, "training": []}

    def script(e: AsyncEngine) -> None:
        seen["training"].append(len(e.server.in_flight))
        if seen["left"] is None and e.version >= 1:
            seen["left"] = e.version
            link.leave("b")
        elif seen["back"] is None and seen["left"] is not None and not e.devices["b"].online and e.version >= 3:
            seen["back"] = e.version
            link.come_back("b")

    assert engine.run(script) is True
    assert seen["back"] is not None and max(seen["training"]) <= 2
    versions = engine.rundir.metrics()
    assert "c" not in versions[0].devices  # c waited for a slot, and took b's when b left
    assert any("c" in v.devices for v in versions[: seen["back"]])
    assert any("b" in v.devices for v in versions[seen["back"] :]), "b did not train again after it came back"
