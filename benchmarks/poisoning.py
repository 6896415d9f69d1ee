"""Poisoning: an honest fleet against 1 and 2 of 10 malicious but authenticated devices.

    python -m benchmarks.poisoning [--json] [--rounds 8] [--strategies fedavg,fedhm] [--attacks ...] [--no-defense]

Ten digits clients (iid shards) run in process through the real round engine and upload gate
(``coordinator.emulation.simulation``). A malicious device trains like the others, then rewrites
what it uploads (it signs what it sends, so only the gate's bounds and the aggregation stand in
its way); label flipping poisons its data instead. The omniscient attacks ("a little is enough",
min-max) see every honest upload of the round before they craft theirs. ``--no-defense`` turns the
update bound, both direction checks and the sample-weight cap off: the gate as it was before them.

The JSON holds ``clean_accuracy`` per strategy, ``attacks`` (one entry per strategy, attack and
number of malicious devices, with the final ``accuracy`` and its ``drop`` from clean), and
``worst_drop_one_in_ten`` / ``worst_drop_two_in_ten`` over them all.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.local_link import InProcessLink, LocalDevice
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.transfer import Completed, make_manifest

MODEL = ModelSpec("cnn", 10, 1, 8)
LEVELS = {"fedavg": (1.0,), "fedhm": (1.0, 0.5, 0.25)}
"""Levels the clients cycle through: FedHM mixes full-rank, gamma 1/2 and 1/4 clients."""
NO_DEFENSE = {
    "update_bound_factor": None,
    "direction_min_cosine": None,
    "peer_min_cosine": None,
    "sample_weight_factor": None,
}

Tensors = dict[str, Tensor]


@dataclass(frozen=True)
class Upload:
    """What a malicious device knows when it crafts its upload."""

    sent: Tensors
    trained: Tensors
    honest: list[Tensors]
    """This round's honest uploads of the same shapes (used by the omniscient attacks only)."""


def floats(tensors: Mapping[str, Tensor]) -> list[str]:
    return [k for k, v in tensors.items() if v.is_floating_point()]


def scaled_weights(factor: float) -> Callable[[Upload], Tensors]:
    """Upload ``factor`` x the weights sent: the attack the old 10x norm bound let through at -9.5."""
    return lambda u: {**u.trained, **{k: factor * u.sent[k] for k in floats(u.trained)}}


def scaled_update(factor: float) -> Callable[[Upload], Tensors]:
    """Upload sent + ``factor`` x the honest update; -1 is the sign flip."""
    return lambda u: {**u.trained, **{k: u.sent[k] + factor * (u.trained[k] - u.sent[k]) for k in floats(u.trained)}}


def gaussian(sigma: float) -> Callable[[Upload], Tensors]:
    """Upload what was sent plus N(0, sigma^2) noise on every weight."""

    def attack(u: Upload) -> Tensors:
        generator = torch.Generator().manual_seed(1)
        noise = {k: sigma * torch.randn(u.sent[k].shape, generator=generator) for k in floats(u.trained)}
        return {**u.trained, **{k: u.sent[k] + noise[k] for k in noise}}

    return attack


def flattened(uploads: Sequence[Tensors], keys: Sequence[str]) -> Tensor:
    return torch.stack([torch.cat([u[k].reshape(-1) for k in keys]) for u in uploads]).to(torch.float64)


def unflattened(vector: Tensor, like: Tensors, keys: Sequence[str]) -> Tensors:
    out, start = dict(like), 0
    for key in keys:
        size = like[key].numel()
        out[key] = vector[start : start + size].reshape(like[key].shape).to(like[key].dtype)
        start += size
    return out


def little_is_enough(z: float) -> Callable[[Upload], Tensors]:
    """Baruch et al. 2019: every coordinate at the honest mean minus z standard deviations.

    Small enough per coordinate to pass median- and distance-based rules, consistent across the
    malicious devices; the paper's z_max for n = 10 and m = 1 is 0 (harmless), so z = 1 is stronger.
    """

    def attack(u: Upload) -> Tensors:
        keys = floats(u.trained)
        honest = flattened(u.honest, keys)
        return unflattened(honest.mean(0) - z * honest.std(0), u.trained, keys)

    return attack


def min_max(u: Upload) -> Tensors:
    """Shejwalkar & Houmansadr 2021 (AGR-agnostic Min-Max): the honest mean pushed along -std as far as
    its largest distance to an honest upload stays within the largest distance between two honest ones."""
    keys = floats(u.trained)
    honest = flattened(u.honest, keys)
    mean, direction = honest.mean(0), -honest.std(0)
    limit = float(torch.cdist(honest, honest).max())
    low, high = 0.0, 100.0
    for _ in range(40):
        gamma = (low + high) / 2
        if float((honest - (mean + gamma * direction)).norm(dim=1).max()) <= limit:
            low = gamma
        else:
            high = gamma
    return unflattened(mean + low * direction, u.trained, keys)


def colluding_reversal(u: Upload) -> Tensors:
    """Upload sent minus the mean honest update of the round: every colluder of one level sends the same
    reversed update, so each would vote for the other in a leave-one-out reference."""
    keys = floats(u.trained)
    mean = {k: torch.stack([h[k] for h in u.honest]).mean(dim=0) for k in keys} if u.honest else u.trained
    return {**u.trained, **{k: u.sent[k] - (mean[k] - u.sent[k]) for k in keys}}


ATTACKS: dict[str, Callable[[Upload], Tensors] | None] = {
    "weights_x-1": scaled_weights(-1.0),
    "weights_x-3": scaled_weights(-3.0),
    "weights_x-9.5": scaled_weights(-9.5),
    "weights_x9.5": scaled_weights(9.5),
    "weights_x-9.5_samples_x97": scaled_weights(-9.5),
    "update_x-1": scaled_update(-1.0),
    "update_x-3": scaled_update(-3.0),
    "update_x-9.5": scaled_update(-9.5),
    "update_x9.5": scaled_update(9.5),
    "gaussian_0.5": gaussian(0.5),
    "label_flip": None,
    "little_is_enough": little_is_enough(1.0),
    "min_max": min_max,
    "colluders_reversed": colluding_reversal,
}
"""Model-poisoning attacks by name; ``label_flip`` poisons the data (labels y -> 9 - y) and uploads honestly."""
SAMPLE_INFLATION = {"weights_x-9.5_samples_x97": 97}
"""Attacks that also claim this many times their real samples (under the gate's 100x refusal bound)."""


class PoisoningLink(InProcessLink):
    """In-process devices of which ``malicious`` rewrite their upload with ``attack`` after training.

    Malicious uploads are held until every honest one of the round is in, so the omniscient attacks
    see them; the engine receives them last (as a slow device's).
    """

    def __init__(
        self, devices: Sequence[LocalDevice], malicious: set[str], attack: Callable[[Upload], Tensors] | None, name: str
    ) -> None:
        super().__init__(devices)
        self.malicious, self.attack, self.name = malicious, attack, name
        self._sent: dict[str, Tensors] = {}
        self._honest: dict[int, list[Tensors]] = {}
        self._held: dict[int, list[tuple[str, Completed]]] = {}
        self._lock = threading.Lock()

    def send_payload(self, device: str, payload: bytes, manifest: Any) -> str:
        self._sent[device] = decode_tensors(payload)
        return super().send_payload(device, payload, manifest)

    def start(self, on_message, on_payload, on_refused=None) -> None:  # type: ignore[no-untyped-def]
        honest_count = len(self.devices) - len(self.malicious)

        def intercept(device: str, completed: Completed) -> None:
            round_ = completed.manifest.round
            with self._lock:
                if device not in self.malicious:
                    self._honest.setdefault(round_, []).append(decode_tensors(completed.data))
                    release = len(self._honest[round_]) == honest_count
                    ready = [(device, completed)] + (self._held.pop(round_, []) if release else [])
                else:
                    self._held.setdefault(round_, []).append((device, completed))
                    ready = self._held.pop(round_) if len(self._honest.get(round_, [])) >= honest_count else []
            for sender, upload in ready:
                on_payload(sender, self._tampered(sender, upload) if sender in self.malicious else upload)

        super().start(on_message, intercept, on_refused)

    def _tampered(self, device: str, completed: Completed) -> Completed:
        manifest = completed.manifest
        meta = dict(manifest.meta)
        if self.name in SAMPLE_INFLATION:
            meta["samples"] = str(int(meta["samples"]) * SAMPLE_INFLATION[self.name])
        if self.attack is None:
            tensors = decode_tensors(completed.data)
        else:
            trained = decode_tensors(completed.data)
            shapes = {k: v.shape for k, v in trained.items()}
            honest = [h for h in self._honest[manifest.round] if {k: v.shape for k, v in h.items()} == shapes]
            tensors = self.attack(Upload(self._sent[device], trained, honest))
        data = encode_tensors(tensors)
        return Completed(
            make_manifest(data, run=manifest.run, round=manifest.round, kind=manifest.kind, meta=meta), [data]
        )


def fleet_clients(
    data: LabeledData, count: int, malicious: int, label_flip: bool, levels: Sequence[float]
) -> list[SimClient]:
    """``count`` iid digits clients; the first ``malicious`` have labels y -> 9 - y when ``label_flip``."""
    spec = PartitionSpec("iid", count, seed=0)
    clients = []
    for i in range(count):
        x, y = client_shard(data.train_x, data.train_y, spec, i)
        if label_flip and i < malicious:
            y = data.num_classes - 1 - y
        clients.append(
            SimClient(f"c{i}", levels[i % len(levels)], (x, y), client_shard(data.test_x, data.test_y, spec, i))
        )
    return clients


def run_one(
    strategy_name: str,
    attack: str | None,
    malicious: int,
    rounds: int,
    clients: int,
    train: TrainConfig,
    data: LabeledData,
    limits: Mapping[str, object] | None,
) -> tuple[float, int]:
    """Final global accuracy of one run (``attack`` None: the clean fleet) and how many honest updates the
    gate refused (a round's honest device whose update was not aggregated)."""
    fleet = fleet_clients(data, clients, malicious, attack == "label_flip", LEVELS[strategy_name])
    bad = {c.client_id for c in fleet[:malicious]} if attack else set()
    devices = [LocalDevice(c.client_id, c.train, c.test) for c in fleet]
    link = PoisoningLink(devices, bad, ATTACKS.get(attack or ""), attack or "")
    strategy = build_strategy(strategy_name, MODEL, {}, seed=0)
    test = (data.test_x, data.test_y)
    result = simulate(strategy, fleet, rounds, train, test, data.train_x[:256], link=link, limits=limits)
    accuracy = result.final.accuracy
    if accuracy is None or not math.isfinite(accuracy):
        raise RuntimeError(f"{strategy_name} {attack}: no final accuracy")
    honest = {c.client_id for c in fleet} - bad
    return accuracy, sum(len(honest - set(record.upload_bytes)) for record in result.rounds)


def poisoning(
    strategies: Sequence[str],
    attacks: Sequence[str],
    fractions: Sequence[int],
    rounds: int,
    clients: int,
    train: TrainConfig,
    defense: bool = True,
    progress: Callable[[str], None] = lambda _line: None,
    limits: Mapping[str, object] | None = None,
) -> dict[str, Any]:
    """Clean and attacked runs; ``limits`` (fleet.yaml's section) tunes the gate, ``defense=False`` turns it off."""
    data = load_dataset("digits", 8, 1)
    limits = {**(limits or {}), **({} if defense else NO_DEFENSE)}
    clean: dict[str, float] = {}
    honest_refused_clean: dict[str, int] = {}
    entries: list[dict[str, Any]] = []
    for name in strategies:
        clean[name], honest_refused_clean[name] = run_one(name, None, 0, rounds, clients, train, data, limits)
        progress(f"{name} clean: {clean[name]:.3f} ({honest_refused_clean[name]} honest updates refused)")
        for attack in attacks:
            for malicious in fractions:
                accuracy, refused = run_one(name, attack, malicious, rounds, clients, train, data, limits)
                drop = clean[name] - accuracy
                entries.append(
                    {
                        "strategy": name,
                        "attack": attack,
                        "malicious": malicious,
                        "accuracy": accuracy,
                        "drop": drop,
                        "honest_refused": refused,
                    }
                )
                result = f"{accuracy:.3f} (drop {drop:+.3f}, {refused} honest refused)"
                progress(f"{name} {attack} {malicious}/{clients}: {result}")

    def worst(malicious: int) -> float | None:
        drops = [e["drop"] for e in entries if e["malicious"] == malicious]
        return max(drops) if drops else None

    return {
        "settings": {
            "clients": clients,
            "rounds": rounds,
            "epochs": train.epochs,
            "model": MODEL.arch,
            "dataset": "digits",
            "defense": "off (update bound, direction checks and sample-weight cap disabled)"
            if not defense
            else "defaults",
            "limits": limits,
        },
        "clean_accuracy": clean,
        "honest_refused_clean": honest_refused_clean,
        "attacks": entries,
        "worst_drop_one_in_ten": worst(max(1, clients // 10)),
        "worst_drop_two_in_ten": worst(max(2, 2 * clients // 10)),
    }


def table(result: Mapping[str, Any]) -> str:
    """A markdown table: one row per strategy and attack, the accuracy with 1 and 2 of 10 malicious."""
    lines = ["| strategy | attack | 1 of 10 | 2 of 10 |", "|---|---|---|---|"]
    for name, accuracy in result["clean_accuracy"].items():
        lines.append(f"| {name} | none (clean) | {accuracy:.3f} | {accuracy:.3f} |")
        rows: dict[str, dict[int, float]] = {}
        for entry in result["attacks"]:
            if entry["strategy"] == name:
                rows.setdefault(entry["attack"], {})[entry["malicious"]] = entry["accuracy"]
        for attack, by_count in rows.items():
            cells = [f"{by_count[m]:.3f}" if m in by_count else "-" for m in (1, 2)]
            lines.append(f"| {name} | {attack} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.poisoning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="fedavg,fedhm", help="comma-separated (default: fedavg,fedhm)")
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated (default: all)")
    parser.add_argument("--malicious", default="1,2", help="malicious device counts (default: 1,2)")
    parser.add_argument("--rounds", type=int, default=8, help="federated rounds (default: 8)")
    parser.add_argument("--clients", type=int, default=10, help="devices in the fleet (default: 10)")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round (default: 1)")
    parser.add_argument(
        "--no-defense", action="store_true", help="turn the update bound, direction checks and weight cap off"
    )
    parser.add_argument(
        "--limits", default="{}", help="fleet.yaml limits as JSON, e.g. '{\"update_bound_factor\": 2}' (default: none)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        print(f"unknown attack {unknown[0]!r}; choose from: {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    fractions = [int(m) for m in args.malicious.split(",") if m]
    if any(not 0 < m < args.clients for m in fractions):
        print(f"--malicious counts must be in 1..{args.clients - 1}", file=sys.stderr)
        return 2
    train = TrainConfig(epochs=args.epochs, batch_size=32, lr=0.05)
    result = poisoning(
        [s for s in args.strategies.split(",") if s],
        attacks,
        fractions,
        args.rounds,
        args.clients,
        train,
        defense=not args.no_defense,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        limits=json.loads(args.limits),
    )
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
