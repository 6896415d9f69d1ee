"""A private round's secure sum: the devices' noise is the round's; a dropout leaves less of it, and it is charged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from coordinator.privacy.accountant import planned_epsilon
from coordinator.privacy.layer import PrivateStrategy
from coordinator.privacy.settings import PrivacySettings
from coordinator.rounds.secure_layouts import PrivateLayout
from coordinator.strategies import ClientSlot, ModelSpec, build_strategy

DEVICES, Z, CLIP, DELTA = 10, 1.5, 0.4, 1e-3


def private() -> tuple[PrivateStrategy, list[ClientSlot]]:
    settings = PrivacySettings(noise_multiplier=Z, clip=CLIP, delta=DELTA)
    strategy = PrivateStrategy(build_strategy("fedavg", ModelSpec("cnn", 10, 1, 8), {}, seed=0), settings, Z, DEVICES)
    return strategy, [ClientSlot(f"d{i}", 1.0, 10 * (i + 1)) for i in range(DEVICES)]


@pytest.mark.parametrize("survivors", [DEVICES, 6])
def test_the_devices_noise_replaces_the_coordinator_s_and_the_ledger_charges_what_survived(survivors: int) -> None:
    strategy, slots = private()
    sent = strategy.configure(1, slots)["d0"].tensors
    layout = PrivateLayout(strategy, sent, slots)
    before = {k: v.clone() for k, v in strategy.global_state().items()}
    aggregate = strategy.open_round(1, slots)
    names = [slot.client_id for slot in slots[:survivors]]
    total = np.full(layout.length, 0.25 * survivors)  # the survivors' (noised) updates summed: 0.25 per value each

    layout.fold(aggregate, total, names)
    aggregate.received.extend(names)
    strategy.close_round(aggregate)
    release = strategy.charge(DEVICES, DEVICES)

    assert layout.noise == pytest.approx(Z * CLIP / math.sqrt(DEVICES))  # each device's share, unweighted
    assert layout.weights is None  # DP-FedAvg's sum is uniform: sample weights would change the sensitivity
    for key in layout.keys:  # no noise added at the coordinator: exactly sent + the mean update
        assert torch.allclose(strategy.global_state()[key].double(), before[key].double() + 0.25, atol=1e-6)
    # m of n survivors carried m / n of the noise variance: z_eff = z sqrt(m / n), charged as such.
    realized = Z * math.sqrt(survivors / DEVICES)
    assert release.noise_multiplier == pytest.approx(realized)
    assert release.epsilon == pytest.approx(planned_epsilon(DEVICES, DEVICES, 1, realized, DELTA))
