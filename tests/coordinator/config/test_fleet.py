"""fleet.yaml validation: every mistake is reported with the key path that holds it."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from coordinator.config.fleet import FleetError, load_fleet, parse_fleet
from coordinator.strategies import STRATEGIES
from device_agent.common.names import DATASETS
from device_agent.models import MODELS
from profiles.catalog import load_catalog
from tests.paths import REPO_ROOT

EXAMPLE = REPO_ROOT / "examples" / "fleet.yaml"
CATALOG = load_catalog()

MINIMAL = {
    "fleet": "lab",
    "transport": {"broker": {"mode": "managed"}},
    "devices": [
        {"id": "nano-01", "profile": "jetson-nano"},
        {"id": "pi5-01", "profile": "raspberry-pi-5"},
    ],
}


def test_the_example_fleet_is_valid() -> None:
    fleet, catalog = load_fleet(EXAMPLE)

    assert fleet.model.arch == "resnet18"
    assert fleet.ratios == [1.0, 0.5, 0.25, 0.125]
    assert {d.profile for d in fleet.devices} - {"reported"} <= set(catalog)


def test_a_minimal_fleet_gets_sane_defaults() -> None:
    fleet = parse_fleet(MINIMAL, CATALOG)

    assert fleet.strategy.name == "fedhm"
    assert fleet.ratios == [1.0, 0.5, 0.25, 0.125]
    assert fleet.training.batch_size == 32
    assert fleet.broker.port == 8883 and fleet.broker.tls  # a provisioned managed broker speaks TLS
    assert fleet.samples_for(fleet.devices[0]) == 50_000 // 2


def test_fractions_are_accepted_and_ratios_sorted() -> None:
    fleet = parse_fleet({**MINIMAL, "ratios": ["1/8", 0.5, 1]}, CATALOG)

    assert fleet.ratios == [1.0, 0.5, 0.125]


def test_partitions_are_written_as_text() -> None:
    fleet = parse_fleet({**MINIMAL, "dataset": {"partition": "dirichlet(0.3)"}}, CATALOG)

    assert (fleet.dataset.partition.kind, fleet.dataset.partition.alpha) == ("dirichlet", 0.3)


def _with(path: str, value: object) -> dict:
    """MINIMAL with the value at a dotted path (list indices as numbers) set; None deletes it."""
    data = copy.deepcopy(MINIMAL)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = data
    for part in parents:
        node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return data


MISTAKES = [
    (
        "devices.1.profile",
        "jetson-nanoo",
        "devices[1].profile: unknown profile 'jetson-nanoo' (did you mean 'jetson-nano'?)",
    ),
    ("ratios", [1, 1.5], "ratios: rank ratio 1.5 is outside (0, 1]"),
    ("ratios", [1, "a quarter"], "ratios: rank ratio 'a quarter' is not a number"),
    ("ratios", [1, 0.5, "1/2"], "ratios: duplicate rank ratios"),
    ("devices.1.id", "nano-01", "devices: duplicate device id 'nano-01' (devices[0] and devices[1])"),
    ("broker", {"mode": "amqtt"}, "(top level): broker: given twice, at the top level and as transport.broker"),
    ("training.batch_size", "lots", "training.batch_size: Input should be a valid integer"),
    ("training.batch_size", 0, "training.batch_size: Input should be greater than 0"),
    ("devices.0.profil", "x", "devices[0].profil: Extra inputs are not permitted (did you mean 'profile'?)"),
    ("transport.broker.mode", "external", "transport.broker: mode external needs url"),
    ("transport.broker.url", "http://broker:1883", "transport.broker: url is only for mode external"),
    ("transport.broker.password", "hunter2", "transport.broker.password: must be a reference like env:NAME"),
    ("transport.broker.port", 70000, "transport.broker.port: Input should be less than or equal to 65535"),
    ("model.arch", "resnet50", "model.arch: unknown model 'resnet50'"),
    (
        "strategy.name",
        "fedprox",
        "strategy.name: unknown strategy 'fedprox'; choose one of: factorized_fl, factorized_fl_beta, fedavg",
    ),
    ("dataset.partition", "dirichlet(lots)", "dataset.partition: dirichlet alpha 'lots' is not a number"),
    ("dataset.partition", "shards", "dataset.partition: 'shards' is not a partition"),
    ("dataset.partition", "dirichlet(0)", "dataset.partition: dirichlet alpha must be > 0"),
    ("dataset.partition", "iid(2)", "dataset.partition: 'iid(2)': iid takes no argument"),
    ("dataset.name", "npz", "dataset: dataset npz needs a path"),
    ("quorum", 1.5, "quorum: Input should be less than or equal to 1"),
    ("devices.0.id", "lab/nano", "devices[0].id: invalid device name 'lab/nano': use 1-64 letters"),
    ("devices.0.credentials", "s3cret", "devices[0].credentials: must be a reference"),
    ("devices.0.overrides", {"max_ratio": "1/3"}, "devices[0].overrides.max_ratio 0.333"),
    ("devices.0.overrides", {"memory": {"total": "lots"}}, "devices[0].overrides.memory.total: could not parse"),
    (
        "devices.0.overrides",
        {"memory": {"reserved": "5 GiB"}},
        "devices[0]: overrides.memory: reserved (5.0GiB) must be below total (4.0GiB)",
    ),
    ("devices", [], "devices: List should have at least 1 item"),
    ("devices.0.id", "coordinator", "devices[0].id: 'coordinator' is the coordinator's broker login"),
    ("transport.broker.username", "fedcoord", "transport.broker: username 'fedcoord' only applies to an external"),
    ("fleet", "my fleet", "fleet: invalid fleet name 'my fleet'"),
    (
        "limits.max_upload_byte",
        1024,
        "limits.max_upload_byte: Extra inputs are not permitted (did you mean 'max_upload_bytes'?)",
    ),
    ("limits.max_upload_bytes", 0, "limits.max_upload_bytes: Input should be greater than 0"),
    ("limits.max_upload_bytes", "lots", "limits.max_upload_bytes: could not parse value and unit"),
    ("limits.messages_per_s", 0, "limits.messages_per_s: Input should be greater than 0"),
    ("limits.message_burst", 2.5, "limits.message_burst: Input should be a valid integer"),
    ("limits.max_open_transfers", 0, "limits.max_open_transfers: Input should be greater than 0"),
    ("limits.norm_bound_factor", 1, "limits.norm_bound_factor: Input should be greater than 1"),
    ("limits.rejected_grace_s", -1, "limits.rejected_grace_s: Input should be greater than or equal to 0"),
    ("limits.resend_after_s", 0, "limits.resend_after_s: Input should be greater than 0"),
    ("transport.kind", "Grpc!", "transport.kind: String should match pattern"),
    ("transport.knd", "mqtt", "transport.knd: Extra inputs are not permitted (did you mean 'kind'?)"),
    ("transport.brokr", {}, "transport.brokr: Extra inputs are not permitted (did you mean 'broker'?)"),
    ("roundz", 3, "roundz: Extra inputs are not permitted (did you mean 'rounds'?)"),
    ("transport.broker.prot", 1883, "transport.broker.prot: Extra inputs are not permitted (did you mean 'port'?)"),
    (
        "devices.0.overrides",
        {"memory": {"totl": "4 GiB"}},
        "devices[0].overrides.memory.totl: Extra inputs are not permitted (did you mean 'total'?)",
    ),
]


@pytest.mark.parametrize(("path", "value", "message"), MISTAKES, ids=[f"{m[0]}={m[1]!r}" for m in MISTAKES])
def test_each_mistake_names_its_key_path(path: str, value: object, message: str) -> None:
    with pytest.raises(FleetError) as info:
        parse_fleet(_with(path, value), CATALOG)

    assert message in str(info.value)


def test_all_mistakes_are_reported_at_once() -> None:
    data = _with("training.batch_size", "lots")
    data["devices"][1]["profile"] = "jetson-nanoo"

    with pytest.raises(FleetError) as info:
        parse_fleet(data, CATALOG)
    assert "training.batch_size" in str(info.value)
    assert "devices[1].profile" in str(info.value)


def test_strategy_parameters_are_validated_by_the_strategy_itself() -> None:
    params = {"weighting": "reference", "temperature": "0.5"}
    fleet = parse_fleet(_with("strategy", {"name": "fedhm", "params": params}), CATALOG)

    assert fleet.strategy.params["weighting"] == "reference"
    assert fleet.strategy.params["temperature"] == 0.5
    with pytest.raises(
        FleetError,
        match=r"strategy\.params\.temprature: Extra inputs are not permitted \(did you mean 'temperature'\?\)",
    ):
        parse_fleet(_with("strategy", {"name": "fedhm", "params": {"temprature": 0.5}}), CATALOG)
    with pytest.raises(FleetError, match=r"strategy\.params\.temperature: Input should be greater than 0"):
        parse_fleet(_with("strategy", {"name": "fedhm", "params": {"temperature": 0}}), CATALOG)


@pytest.mark.parametrize("name", ["fedavg", "factorized_fl", "factorized_fl_beta", "simfed", "fedfac"])
def test_a_strategy_without_size_levels_trains_the_whole_model_everywhere(name: str) -> None:
    fleet = parse_fleet(_with("strategy", {"name": name}), CATALOG)

    assert fleet.ratios == [1.0]
    assert parse_fleet({**_with("strategy", {"name": name}), "ratios": [1]}, CATALOG).ratios == [1.0]


def test_ratios_a_strategy_has_no_use_for_are_an_error_that_says_what_to_write() -> None:
    data = {**_with("strategy", {"name": "factorized_fl"}), "ratios": [1, "1/2"]}

    with pytest.raises(FleetError) as info:
        parse_fleet(data, CATALOG)

    message = str(info.value)
    assert "ratios: 0.5 does not fit strategy 'factorized_fl'" in message
    assert "no size levels" in message
    assert "write `ratios: [1]` or leave ratios out" in message


def test_a_strategy_with_levels_keeps_the_default_ratios_and_rejects_impossible_ones() -> None:
    assert parse_fleet(_with("strategy", {"name": "heterofl"}), CATALOG).ratios == [1.0, 0.5, 0.25, 0.125]
    with pytest.raises(FleetError, match=r"ratios: rank ratio 1.5 is outside \(0, 1\]"):
        parse_fleet({**_with("strategy", {"name": "heterofl"}), "ratios": [1, 1.5]}, CATALOG)


def test_file_level_problems_are_clear(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FleetError, match="cannot read"):
        load_fleet(missing)

    broken = tmp_path / "broken.yaml"
    broken.write_text("fleet: [unclosed\n")
    with pytest.raises(FleetError, match="not valid YAML"):
        load_fleet(broken)

    listed = tmp_path / "list.yaml"
    listed.write_text("- fleet: lab\n")
    with pytest.raises(FleetError, match="expected a mapping"):
        load_fleet(listed)


def test_profile_dirs_are_relative_to_the_fleet_file(tmp_path: Path) -> None:
    (tmp_path / "my-profiles").mkdir()
    custom = yaml.safe_load((Path(CATALOG.origins["raspberry-pi-5"])).read_text())
    custom.update(name="pi5-overclocked", title="Pi 5 at 3 GHz")
    (tmp_path / "my-profiles" / "pi5-overclocked.yaml").write_text(yaml.safe_dump(custom))
    data = _with("devices.1.profile", "pi5-overclocked")
    data["profile_dirs"] = ["my-profiles"]
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(data))

    fleet, catalog = load_fleet(tmp_path / "fleet.yaml")

    assert catalog[fleet.devices[1].profile].title == "Pi 5 at 3 GHz"


def test_a_device_cannot_take_an_external_brokers_coordinator_login() -> None:
    data = _with("transport.broker", {"mode": "external", "url": "mqtt://broker:1883", "username": "fedcoord"})
    data["devices"][1]["id"] = "fedcoord"

    with pytest.raises(FleetError, match=r"devices\[1\]\.id: 'fedcoord' is the coordinator's broker login"):
        parse_fleet(data, CATALOG)
    assert parse_fleet(_with("devices.1.id", "coordinator-2"), CATALOG).devices[1].id == "coordinator-2"


def test_relative_paths_are_relative_to_the_fleet_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _with("dataset", {"name": "npz", "path": "data/train.npz", "samples_per_device": 10})
    data["transport"]["broker"] = {
        "mode": "external",
        "url": "mqtts://broker:8883",
        "ca_file": "ca.pem",
        "password": "file:pw",
    }
    data["devices"][0]["credentials"] = "file:secrets/nano-01"
    data["devices"][1]["credentials"] = "env:PI5_PASSWORD"
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir("/")

    fleet, _ = load_fleet(tmp_path / "fleet.yaml")

    assert fleet.dataset.path == tmp_path / "data" / "train.npz"
    assert fleet.broker.ca_file == tmp_path / "ca.pem"
    assert fleet.broker.password == f"file:{tmp_path / 'pw'}"
    assert fleet.devices[0].credentials == f"file:{tmp_path / 'secrets' / 'nano-01'}"
    assert fleet.devices[1].credentials == "env:PI5_PASSWORD"


def test_the_reference_example_names_every_model_data_set_and_strategy_in_its_comments() -> None:
    comments = " ".join(line.split("#", 1)[1] for line in EXAMPLE.read_text().splitlines() if "#" in line)
    named = set(re.findall(r"[a-z0-9_]+", comments))
    assert {*MODELS, *DATASETS, *STRATEGIES} - named == set()


def test_a_top_level_broker_from_an_older_file_is_read_as_moved_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = copy.deepcopy(MINIMAL)
    data["broker"] = {"mode": "external", "url": "mqtts://broker:8883", "ca_file": "ca.pem"}
    del data["transport"]
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(data))

    fleet, _ = load_fleet(tmp_path / "fleet.yaml")

    assert fleet.transport.broker.url == "mqtts://broker:8883"
    assert fleet.broker.ca_file == tmp_path / "ca.pem"  # still anchored to the file's folder
    assert "the top-level `broker:` section is now `transport.broker:`" in caplog.text


def test_a_fleet_without_a_broker_section_gets_a_managed_tls_broker() -> None:
    data = copy.deepcopy(MINIMAL)
    del data["transport"]

    fleet = parse_fleet(data, CATALOG)

    assert (fleet.transport.kind, fleet.broker.mode, fleet.broker.port, fleet.broker.tls) == (
        "mqtt",
        "managed",
        8883,
        True,
    )
