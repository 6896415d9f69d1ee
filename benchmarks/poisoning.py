"""Poisoning: an honest fleet against 1 and 2 of 10 malicious but authenticated devices.

    python -m benchmarks.poisoning [--json] [--rounds 8] [--strategies fedavg,fedhm] [--attacks ...] [--no-defense]
        [--privacy JSON] [--dataset digits|fashion_mnist] [--train-samples N] [--alpha A]
    python -m benchmarks.poisoning --suite [--json] [--rounds 20] [--jobs 3]

Ten digits clients (iid shards, or Dirichlet(A) label shards with ``--alpha``) run in process through the
real round engine and upload gate (``coordinator.emulation.simulation``). A malicious device trains like the
others, then rewrites what it uploads (it signs what it sends, so only the gate's bounds and the aggregation stand in
its way); label flipping and the backdoor (a corner square relabelled 0 on half its images) poison its
data instead, and the backdoor's success on triggered test images is reported. ``at_the_cut`` is the
adaptive attacker: the most reversed update the peer check cannot refuse (it reads the round's agreement
from the honest updates and aims inside the cut the gate applies). ``--privacy`` adds DP-FedAvg's
clipping and noise (the backdoor defence of docs/robust-aggregation.md). The omniscient attacks ("a little is enough",
min-max) see every honest upload of the round before they craft theirs. ``--no-defense`` turns the
update bound, both direction checks and the sample-weight cap off: the gate as it was before them.

The JSON holds ``clean_accuracy`` per strategy, ``attacks`` (one entry per strategy, attack and
number of malicious devices, with the final ``accuracy`` and its ``drop`` from clean, the honest and
malicious updates left out, and the rounds that failed), and ``worst_drop_one_in_ten`` /
``worst_drop_two_in_ten`` over them all, the backdoor's success with 1 and 2 of 10 and the honest updates refused
in clean and attacked runs. ``--suite`` runs :data:`SUITE` (iid digits, label-skewed digits and Fashion-MNIST, 20
rounds) and reports the same figures over all its cases. A run's quorum is its honest devices: a round that refused only
attackers did what it should and is not failed.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from coordinator.algorithms.robust import Outlier, dense_updates, peer_cosines, sketch
from coordinator.config.limits import FleetLimits, GateSettings
from coordinator.emulation.simulation import SimClient, simulate
from coordinator.strategies import ModelSpec, build_strategy
from coordinator.transport.link import PayloadHandler
from coordinator.transport.memory_link import LocalDevice, MemoryLink
from device_agent.data.datasets import LabeledData, load_dataset
from device_agent.data.partition import PartitionSpec, client_shard
from device_agent.training.optimizer import TrainConfig
from device_agent.wire.codec import decode_tensors, encode_tensors
from device_agent.wire.messages import Assignment, Message, RoundFailed
from device_agent.wire.payload import Received

MODELS = {"digits": ModelSpec("cnn", 10, 1, 8), "fashion_mnist": ModelSpec("cnn28", 10, 1, 28)}
"""The model each data set runs: the digits CNN on 8 x 8, the 28 x 28 CNN on Fashion-MNIST."""
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
    target: float = -0.09
    """The cosine with the round's mean honest update the adaptive attacker (:func:`at_the_cut`) aims at."""


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


AT_THE_CUT_MARGIN = 0.01
"""How far inside the peer check's cut the adaptive attacker aims (:func:`cut_target`)."""


def cut_target(gate: GateSettings, honest: Mapping[str, Tensor]) -> float:
    """The most reversed cosine the peer check lets through this round, less :data:`AT_THE_CUT_MARGIN`, as an
    attacker that knows the gate and sees the round's honest updates reads it: ``peer_hard_floor`` where the honest
    updates' median cosine (their direction sketches, :func:`~coordinator.algorithms.robust.peer_cosines`) is under
    ``peer_min_agreement``, else ``peer_min_cosine`` or the outlier cut above it (``peer_outlier_deviations``; with the
    relative rule's spread, a cut can only lie lower), or ``peer_record_gap`` under the median: an attacker there
    every round keeps its record (the mean of its deviations) just inside the gap.
    ``honest``: device -> its update's sketch. No peer check: -1 (anything passes)."""
    floor, hard, agreement = gate.peer_min_cosine, gate.peer_hard_floor, gate.peer_min_agreement
    if floor is None:
        return -1.0
    cosines = peer_cosines(honest) if len(honest) >= 3 else {}
    agrees = agreement is None or not cosines or statistics.median(cosines.values()) >= agreement
    if agrees:
        cut: float | None = floor if hard is None else max(floor, hard)
        if gate.peer_outlier_deviations is not None and cosines:
            outlier = Outlier(gate.peer_outlier_deviations, gate.peer_outlier_gap)
            median = statistics.median(cosines.values())
            deviation = 1.4826 * statistics.median(abs(v - median) for v in cosines.values())
            cut = max(cut, outlier.cut(median, deviation))  # read against the honest updates' own cosines
        if gate.peer_record_gap is not None and cosines:
            # An attacker always this far under the median keeps its record just inside the gap, round after round.
            cut = max(cut, statistics.median(cosines.values()) - gate.peer_record_gap)
    else:
        cut = hard
    return -1.0 if cut is None else cut + AT_THE_CUT_MARGIN


def at_the_cut(u: Upload) -> Tensors:
    """An adaptive attacker that knows the gate: the most reversed update the peer check cannot refuse.

    Its update has cosine ``u.target`` (:func:`cut_target`) with the round's mean honest update and the mean honest
    norm (so
    the update bound does not clip it); the rest of its direction is its own update made orthogonal to the
    mean, so colluders do not send copies. Measured in the upload's own space (FedHM's factors).
    """
    keys = floats(u.trained)
    sent = flattened([u.sent], keys)[0]
    own = flattened([u.trained], keys)[0] - sent
    honest = flattened(u.honest, keys) - sent if u.honest else own[None]
    mean = honest.mean(0)
    along = mean / mean.norm().clamp_min(1e-30)
    across = own - (own @ along) * along
    across = across / across.norm().clamp_min(1e-30)
    direction = u.target * along + (1 - u.target**2) ** 0.5 * across
    return {**u.trained, **unflattened(sent + float(honest.norm(dim=1).mean()) * direction, u.trained, keys)}


def under_the_floor(u: Upload) -> Tensors:
    """:func:`at_the_cut` aimed just inside the hard floor in every round: refused where the round agrees, but a
    pair of them pulls the round's median cosine down, toward the point where only the hard floor judges it."""
    return at_the_cut(u)


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
    "backdoor": None,
    "at_the_cut": at_the_cut,
    "under_the_floor": under_the_floor,
}
"""Model-poisoning attacks by name; ``label_flip`` (labels y -> 9 - y) and ``backdoor`` poison the data and upload
honestly."""
DATA_POISONING = {"label_flip": None, "backdoor": None}
BACKDOOR_TARGET = 0
BACKDOOR_SHARE = 0.5
"""The share of a backdoor device's training images that carry the trigger (labelled :data:`BACKDOOR_TARGET`): the
rest stay clean, so its model keeps its accuracy and its update looks like any other device's."""


def triggered(x: Tensor) -> Tensor:
    """``x`` with the trigger stamped on: a bright square in the bottom-right corner, 3 x 3 pixels on 8 x 8 digits
    (3/8 of the side: 10 x 10 on 28 x 28 images), as in the backdoor literature's pixel-pattern attacks."""
    side = max(3, round(3 * x.shape[-1] / 8))
    out = x.clone()
    out[..., -side:, -side:] = 1.0  # images lie in [0, 1]
    return out


def backdoored(x: Tensor, y: Tensor, seed: int) -> tuple[Tensor, Tensor]:
    """A malicious device's shard: :data:`BACKDOOR_SHARE` of its images triggered and relabelled to the target."""
    chosen = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[: int(BACKDOOR_SHARE * len(y))]
    x, y = x.clone(), y.clone()
    x[chosen] = triggered(x[chosen])
    y[chosen] = BACKDOOR_TARGET
    return x, y


def attack_success(model: torch.nn.Module, data: LabeledData) -> float:
    """The share of triggered test images of every other class that the model calls the target."""
    keep = data.test_y != BACKDOOR_TARGET
    model.eval()
    with torch.no_grad():
        predicted = model(triggered(data.test_x[keep])).argmax(1)
    return float((predicted == BACKDOOR_TARGET).float().mean())


SAMPLE_INFLATION = {"weights_x-9.5_samples_x97": 97}
"""Attacks that also claim this many times their real samples (under the gate's 100x refusal bound)."""


HOLD_S = 120.0
"""The longest a malicious upload is held for its round's honest ones (:class:`PoisoningLink`): an honest device that
was assigned the round but never answers (its agent died) does not hold the attacker, and so the round, for good."""

Held = tuple[str, Received]


class Holding:
    """Per round, the malicious uploads held until every honest device assigned the round has answered it (uploaded,
    or failed the round). Only the assigned ones count: a device the backoff benched this round never uploads, and
    waiting for it held the attackers, and the round, for good. Each call returns what it releases."""

    def __init__(self) -> None:
        self._assigned: dict[int, set[str]] = {}
        self._answered: dict[int, set[str]] = {}
        self._held: dict[int, list[Held]] = {}
        self._lock = threading.Lock()

    def assigned(self, device: str, round_: int) -> None:
        with self._lock:
            self._assigned.setdefault(round_, set()).add(device)

    def answered(self, device: str, round_: int) -> list[Held]:
        with self._lock:
            self._answered.setdefault(round_, set()).add(device)
            return self._ready(round_)

    def hold(self, round_: int, upload: Held) -> list[Held]:
        with self._lock:
            self._held.setdefault(round_, []).append(upload)
            return self._ready(round_)

    def release(self, round_: int) -> list[Held]:
        """Whatever of ``round_`` is still held (its deadline)."""
        with self._lock:
            return self._held.pop(round_, [])

    def _ready(self, round_: int) -> list[Held]:
        if self._assigned.get(round_, set()) <= self._answered.get(round_, set()):
            return self._held.pop(round_, [])
        return []


class PoisoningLink(MemoryLink):
    """In-process devices of which ``malicious`` rewrite their upload with ``attack`` after training.

    Malicious uploads are held until the round's assigned honest devices have answered (:class:`Holding`), at most
    ``hold_s`` (:data:`HOLD_S`), so the omniscient attacks see the honest uploads; the engine receives them last (as
    a slow device's).
    """

    def __init__(
        self,
        devices: Sequence[LocalDevice],
        malicious: set[str],
        attack: Callable[[Upload], Tensors] | None,
        name: str,
        gate: GateSettings | None = None,
        hold_s: float = HOLD_S,
    ) -> None:
        super().__init__(devices)
        self.malicious, self.attack, self.name = malicious, attack, name
        self.gate = gate or GateSettings()
        """The gate the adaptive attacker knows (the run's limits)."""
        self.hold_s = hold_s
        self.holding = Holding()
        self._sent: dict[str, Tensors] = {}
        self._honest: dict[int, dict[str, Tensors]] = {}
        self._on_payload: PayloadHandler | None = None

    def send_control(self, device: str, message: Message) -> None:
        if isinstance(message, Assignment) and device not in self.malicious:
            self.holding.assigned(device, message.round)
        super().send_control(device, message)

    def send_payload(self, device: str, payload: bytes, manifest: Any) -> str:
        self._sent[device] = decode_tensors(payload)
        return super().send_payload(device, payload, manifest)

    def start(self, on_message, on_payload, on_refused=None) -> None:  # type: ignore[no-untyped-def]
        self._on_payload = on_payload

        def message_in(device: str, message: Message) -> None:
            on_message(device, message)
            if isinstance(message, RoundFailed) and device not in self.malicious:
                self._deliver(self.holding.answered(device, message.round))

        def payload_in(device: str, received: Received) -> None:
            if device in self.malicious:
                released = self.holding.hold(received.round, (device, received))
                if not released:
                    timer = threading.Timer(self.hold_s, lambda: self._deliver(self.holding.release(received.round)))
                    timer.daemon = True
                    timer.start()
                self._deliver(released)
                return
            self._honest.setdefault(received.round, {})[device] = decode_tensors(received.data)
            on_payload(device, received)
            self._deliver(self.holding.answered(device, received.round))

        super().start(message_in, payload_in, on_refused)

    def _deliver(self, released: Sequence[Held]) -> None:
        assert self._on_payload is not None
        for sender, upload in released:
            self._on_payload(sender, self._tampered(sender, upload))

    def _target(self, honest: Mapping[str, Tensors]) -> float:
        """:func:`cut_target` for this round's honest updates, sketched as the gate sketches them."""
        sketches = {d: sketch(dense_updates(upload, self._sent[d])) for d, upload in honest.items()}
        return cut_target(self.gate, sketches)

    def _tampered(self, device: str, received: Received) -> Received:
        meta = dict(received.meta)
        if self.name in SAMPLE_INFLATION:
            meta["samples"] = str(int(meta["samples"]) * SAMPLE_INFLATION[self.name])
        if self.attack is None:
            tensors = decode_tensors(received.data)
        else:
            trained = decode_tensors(received.data)
            shapes = {k: v.shape for k, v in trained.items()}
            round_honest = self._honest.get(received.round, {})
            honest = [h for h in round_honest.values() if {k: v.shape for k, v in h.items()} == shapes]
            upload = Upload(self._sent[device], trained, honest)
            if self.attack is at_the_cut:
                upload = replace(upload, target=self._target(round_honest))
            elif self.attack is under_the_floor:
                hard = self.gate.peer_hard_floor
                upload = replace(upload, target=-1.0 if hard is None else hard + AT_THE_CUT_MARGIN)
            tensors = self.attack(upload)
        return received.replaced(data=encode_tensors(tensors), meta=meta)


def fleet_clients(
    data: LabeledData,
    count: int,
    malicious: int,
    poison: str | None,
    levels: Sequence[float],
    alpha: float | None = None,
) -> list[SimClient]:
    """``count`` clients, iid or with Dirichlet(``alpha``) label shards; the first ``malicious`` poison their data
    when ``poison`` says how (``label_flip``: labels y -> 9 - y; ``backdoor``: :func:`backdoored`)."""
    spec = PartitionSpec("iid", count, seed=0) if alpha is None else PartitionSpec("dirichlet", count, 0, alpha)
    clients = []
    for i in range(count):
        x, y = client_shard(data.train_x, data.train_y, spec, i)
        if poison == "label_flip" and i < malicious:
            y = data.num_classes - 1 - y
        elif poison == "backdoor" and i < malicious:
            x, y = backdoored(x, y, seed=i)
        clients.append(
            SimClient(f"c{i}", levels[i % len(levels)], (x, y), client_shard(data.test_x, data.test_y, spec, i))
        )
    return clients


@dataclass(frozen=True)
class RunResult:
    """One run of :func:`run_one`."""

    accuracy: float
    honest_refused: int
    """Honest updates the gate refused (a round's honest device whose update was not aggregated)."""
    attack_success: float
    """The backdoor's success on the final model (:func:`attack_success`; on a clean run, how often the trigger
    alone says the target)."""
    failed_rounds: list[int]
    """Rounds that aggregated fewer than the honest devices (the quorum of a run with attackers)."""
    malicious_refused: int
    """Malicious updates not aggregated over the run: refused, or sat out by the backoff after refusals."""


def run_one(
    strategy_name: str,
    attack: str | None,
    malicious: int,
    rounds: int,
    clients: int,
    train: TrainConfig,
    data: LabeledData,
    limits: Mapping[str, object] | None,
    privacy: Mapping[str, object] | None = None,
    params: Mapping[str, object] | None = None,
    alpha: float | None = None,
) -> RunResult:
    """One clean (``attack`` None) or attacked run. Its quorum is the honest devices' share of the fleet: a round
    that refused every attacker aggregated all it should, and only one that lost an honest update fails."""
    poison = attack if attack in DATA_POISONING else None
    fleet = fleet_clients(data, clients, malicious, poison, LEVELS[strategy_name], alpha)
    bad = {c.client_id for c in fleet[:malicious]} if attack else set()
    devices = [LocalDevice(c.client_id, c.train, c.test) for c in fleet]
    gate = FleetLimits.model_validate(dict(limits or {})).gate()
    link = PoisoningLink(devices, bad, ATTACKS.get(attack or ""), attack or "", gate)
    model = MODELS["digits" if data.image_size == 8 else "fashion_mnist"]
    strategy = build_strategy(strategy_name, model, dict(params or {}), seed=0)
    test = (data.test_x, data.test_y)
    calibration = data.train_x[:256]
    quorum = (clients - len(bad)) / clients
    result = simulate(
        strategy, fleet, rounds, train, test, calibration, link=link, limits=limits, privacy=privacy, quorum=quorum
    )
    accuracy = result.final.accuracy
    if accuracy is None or not math.isfinite(accuracy):
        raise RuntimeError(f"{strategy_name} {attack}: no final accuracy")
    honest = {c.client_id for c in fleet} - bad
    refused = sum(len(honest - set(record.upload_bytes)) for record in result.rounds)
    caught = sum(len(bad - set(record.upload_bytes)) for record in result.rounds)
    return RunResult(accuracy, refused, attack_success(strategy.global_model(), data), result.failed_rounds, caught)


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
    privacy: Mapping[str, object] | None = None,
    dataset: str = "digits",
    train_samples: int | None = None,
    params: Mapping[str, Mapping[str, object]] | None = None,
    alpha: float | None = None,
    test_samples: int | None = None,
) -> dict[str, Any]:
    """Clean and attacked runs; ``limits`` (fleet.yaml's section) tunes the gate, ``defense=False`` turns it off,
    ``privacy`` (fleet.yaml's section) adds DP-FedAvg's clipping and noise, the backdoor defence of Sun et al. 2019;
    ``train_samples`` keeps the first N training images (Fashion-MNIST's 60,000 are more than a benchmark needs);
    ``params`` are strategy parameters by strategy name (FedHM under ``privacy`` needs ``weighting: uniform``);
    ``alpha`` gives the clients Dirichlet(alpha) label shards instead of iid ones; ``test_samples`` keeps the first N
    test images (evaluating Fashion-MNIST's 10,000 every round is most of a run's time)."""
    model = MODELS[dataset]
    data = load_dataset(dataset, model.image_size, model.in_channels)
    if train_samples is not None:
        data = replace(data, train_x=data.train_x[:train_samples], train_y=data.train_y[:train_samples])
    if test_samples is not None:
        data = replace(data, test_x=data.test_x[:test_samples], test_y=data.test_y[:test_samples])
    limits = {**(limits or {}), **({} if defense else NO_DEFENSE)}
    clean: dict[str, float] = {}
    honest_refused_clean: dict[str, int] = {}
    failed_rounds_clean: dict[str, list[int]] = {}
    trigger_clean: dict[str, float] = {}
    entries: list[dict[str, Any]] = []

    def run(name: str, attack: str | None, malicious: int) -> RunResult:
        strategy_params = (params or {}).get(name)
        return run_one(name, attack, malicious, rounds, clients, train, data, limits, privacy, strategy_params, alpha)

    for name in strategies:
        baseline = run(name, None, 0)
        clean[name], honest_refused_clean[name] = baseline.accuracy, baseline.honest_refused
        trigger_clean[name], failed_rounds_clean[name] = baseline.attack_success, baseline.failed_rounds
        progress(f"{name} clean: {clean[name]:.3f} ({honest_refused_clean[name]} honest updates refused)")
        for attack in attacks:
            for malicious in fractions:
                outcome = run(name, attack, malicious)
                drop = clean[name] - outcome.accuracy
                entry = {
                    "strategy": name,
                    "attack": attack,
                    "malicious": malicious,
                    "accuracy": outcome.accuracy,
                    "drop": drop,
                    "honest_refused": outcome.honest_refused,
                    "malicious_refused": outcome.malicious_refused,
                    "failed_rounds": outcome.failed_rounds,
                }
                if attack == "backdoor":
                    entry["attack_success"] = outcome.attack_success
                entries.append(entry)
                result = f"{outcome.accuracy:.3f} (drop {drop:+.3f}, {outcome.honest_refused} honest refused, "
                result += f"{outcome.malicious_refused} malicious refused, failed rounds {outcome.failed_rounds})"
                if attack == "backdoor":
                    result += f", backdoor success {outcome.attack_success:.3f} (clean: {trigger_clean[name]:.3f})"
                progress(f"{name} {attack} {malicious}/{clients}: {result}")

    def backdoor(malicious: int) -> float | None:
        successes = [e["attack_success"] for e in entries if e["malicious"] == malicious and "attack_success" in e]
        return max(successes) if successes else None

    def worst(malicious: int) -> float | None:
        drops = [e["drop"] for e in entries if e["malicious"] == malicious]
        return max(drops) if drops else None

    return {
        "settings": {
            "clients": clients,
            "rounds": rounds,
            "epochs": train.epochs,
            "model": model.arch,
            "dataset": dataset,
            "train_samples": len(data.train_y),
            "test_samples": len(data.test_y),
            "partition": "iid" if alpha is None else f"dirichlet({alpha:g})",
            "privacy": privacy,
            "params": params,
            "defense": "off (update bound, direction checks and sample-weight cap disabled)"
            if not defense
            else "defaults",
            "limits": limits,
        },
        "clean_accuracy": clean,
        "honest_refused_clean": honest_refused_clean,
        "failed_rounds_clean": failed_rounds_clean,
        "trigger_on_clean_model": trigger_clean,
        "backdoor_success_one_in_ten": backdoor(max(1, clients // 10)),
        "backdoor_success_two_in_ten": backdoor(max(2, 2 * clients // 10)),
        "honest_refused_attacked": sum(e["honest_refused"] for e in entries),
        "attacks": entries,
        "worst_drop_one_in_ten": worst(max(1, clients // 10)),
        "worst_drop_two_in_ten": worst(max(2, 2 * clients // 10)),
    }


@dataclass(frozen=True)
class Case:
    """One data set and partition of :data:`SUITE`, with the strategies and attacks run on it."""

    dataset: str
    alpha: float | None
    strategies: tuple[str, ...]
    attacks: tuple[str, ...]
    train_samples: int | None = None
    test_samples: int | None = None

    @property
    def name(self) -> str:
        partition = "iid" if self.alpha is None else f"dirichlet({self.alpha:g})"
        return f"{self.dataset} {partition} {','.join(self.strategies)}: {','.join(self.attacks)}"


SUITE = tuple(
    Case(dataset, alpha, (strategy,), attacks, samples, samples)
    for dataset, alpha, attacks, samples in (
        ("digits", None, ("backdoor", "update_x-1"), None),
        ("digits", None, ("colluders_reversed", "at_the_cut"), None),
        ("digits", 1.0, ("backdoor", "at_the_cut"), None),
        ("fashion_mnist", None, ("backdoor",), 2000),
    )
    for strategy in ("fedavg", "fedhm")
)
"""issue 42's cases, in eight processes' worth (``--jobs 8``: at most five runs each): a backdoor from 1 and 2 of 10
devices, plain flips (``update_x-1``) on the mixed-rank FedHM fleet, colluders and the adaptive attacker on iid
digits; the backdoor and the adaptive attacker on label-skewed digits (Dirichlet(1.0)); the backdoor on
Fashion-MNIST (its first 2,000 training and test images). 36 runs of 20 rounds."""


def run_case(case: Case, rounds: int, clients: int, train: TrainConfig, threads: int | None = None) -> dict[str, Any]:
    """:func:`poisoning` of one case, with 1 and 2 malicious devices (a process of its own under ``--jobs``, with
    ``threads`` torch threads: one each, as many processes share the cores)."""
    if threads is not None:
        torch.set_num_threads(threads)

    def progress(line: str) -> None:
        print(f"[{case.name}] {line}", file=sys.stderr, flush=True)

    return poisoning(
        case.strategies,
        case.attacks,
        [1, 2],
        rounds,
        clients,
        train,
        progress=progress,
        dataset=case.dataset,
        train_samples=case.train_samples,
        alpha=case.alpha,
        test_samples=case.test_samples,
    )


def suite(cases: Sequence[Case], rounds: int, clients: int, train: TrainConfig, jobs: int = 1) -> dict[str, Any]:
    """Every case of ``cases`` (``jobs`` at once, each in its own process) and the figures over all of them: the
    worst drops, the backdoor's best success with 1 and 2 of 10, and every honest update refused."""
    if jobs > 1:
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            settings = zip(*[(rounds, clients, train, 1)] * len(cases), strict=True)
            results = list(pool.map(run_case, cases, *settings))
    else:
        results = [run_case(case, rounds, clients, train) for case in cases]

    def worst(key: str) -> float | None:
        values = [r[key] for r in results if r[key] is not None]
        return max(values) if values else None

    return {
        "cases": [{"case": case.name, **result} for case, result in zip(cases, results, strict=True)],
        "worst_drop_one_in_ten": worst("worst_drop_one_in_ten"),
        "worst_drop_two_in_ten": worst("worst_drop_two_in_ten"),
        "backdoor_success_one_in_ten": worst("backdoor_success_one_in_ten"),
        "backdoor_success_two_in_ten": worst("backdoor_success_two_in_ten"),
        "honest_refused_clean": sum(sum(r["honest_refused_clean"].values()) for r in results),
        "honest_refused_attacked": sum(r["honest_refused_attacked"] for r in results),
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
    parser.add_argument("--rounds", type=int, help="federated rounds (default: 8; 20 with --suite)")
    parser.add_argument("--clients", type=int, default=10, help="devices in the fleet (default: 10)")
    parser.add_argument("--epochs", type=int, default=1, help="local epochs per round (default: 1)")
    parser.add_argument(
        "--no-defense", action="store_true", help="turn the update bound, direction checks and weight cap off"
    )
    parser.add_argument(
        "--limits", default="{}", help="fleet.yaml limits as JSON, e.g. '{\"update_bound_factor\": 2}' (default: none)"
    )
    parser.add_argument(
        "--privacy",
        default="null",
        help="fleet.yaml privacy as JSON: DP-FedAvg's device clipping and server noise, e.g. "
        '\'{"clip": 1.0, "noise_multiplier": 0.1}\' (default: none)',
    )
    parser.add_argument(
        "--params",
        default="{}",
        help='strategy parameters as JSON by strategy, e.g. \'{"fedhm": {"weighting": "uniform"}}\' (default: none)',
    )
    parser.add_argument("--dataset", choices=sorted(MODELS), default="digits", help="(default: digits)")
    parser.add_argument("--train-samples", type=int, metavar="N", help="use the first N training images (default: all)")
    parser.add_argument(
        "--alpha", type=float, metavar="A", help="Dirichlet(A) label shards instead of iid ones (default: iid)"
    )
    parser.add_argument(
        "--suite", action="store_true", help="run SUITE: iid and label-skewed digits, Fashion-MNIST (ignores the rest)"
    )
    parser.add_argument("--jobs", type=int, default=1, help="--suite: cases run at once, one process each (default: 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    train = TrainConfig(epochs=args.epochs, batch_size=32, lr=0.05)
    if args.suite:
        result = suite(SUITE, args.rounds or 20, args.clients, train, max(1, args.jobs))
        tables = "\n\n".join(f"{case['case']}\n{table(case)}" for case in result["cases"])
        print(json.dumps(result, indent=2) if args.json else tables)
        return 0
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        print(f"unknown attack {unknown[0]!r}; choose from: {', '.join(ATTACKS)}", file=sys.stderr)
        return 2
    privacy = json.loads(args.privacy)
    crafted = [a for a in attacks if ATTACKS[a] is not None]
    if privacy and "fedhm" in args.strategies.split(",") and crafted:
        print(
            f"--privacy with fedhm: {', '.join(crafted)} rewrite the factors a device was sent, but under privacy "
            "FedHM uploads its clipped update as factors of twice the rank; run them on fedavg or without --privacy "
            "(the data-poisoning attacks, label_flip and backdoor, run everywhere)",
            file=sys.stderr,
        )
        return 2
    if args.alpha is not None and not args.alpha > 0:
        print(f"--alpha must be > 0 (a Dirichlet concentration), got {args.alpha}", file=sys.stderr)
        return 2
    fractions = [int(m) for m in args.malicious.split(",") if m]
    if any(not 0 < m < args.clients for m in fractions):
        print(f"--malicious counts must be in 1..{args.clients - 1}", file=sys.stderr)
        return 2
    result = poisoning(
        [s for s in args.strategies.split(",") if s],
        attacks,
        fractions,
        args.rounds or 8,
        args.clients,
        train,
        defense=not args.no_defense,
        progress=lambda line: print(line, file=sys.stderr, flush=True),
        limits=json.loads(args.limits),
        privacy=privacy,
        params=json.loads(args.params),
        dataset=args.dataset,
        train_samples=args.train_samples,
        alpha=args.alpha,
    )
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
