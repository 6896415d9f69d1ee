"""Federated evaluation on a device: the model it received, measured on its own test shard before training.

A coordinator with no data of its own learns how the global model does from these figures (the
round's ``federated_accuracy``). The device measures the model as it arrived, so the figure of round
r is the global model after round r - 1. BatchNorm statistics are recomputed on (at most
``CALIBRATION_SAMPLES`` of) the device's training shard first (static BN, as for ``local_accuracy``),
then restored, so training starts from exactly what was received.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from device_agent.clients.base import ClientProgram
from device_agent.training.optimizer import calibrate_batchnorm
from device_agent.wire.protocol import ReceivedEvaluation

Split = tuple[Tensor, Tensor]

CALIBRATION_SAMPLES = 1024
"""As many as the coordinator's own static BN uses: enough for the statistics, a bounded cost on a big shard."""


@torch.no_grad()
def evaluate_received(
    program: ClientProgram, test: Split, calibration: Tensor, device: torch.device | str = "cpu"
) -> ReceivedEvaluation | None:
    """Accuracy and cross-entropy of ``program.model`` on ``test``; None when the device has no test shard."""
    x, y = test
    if len(y) == 0:
        return None
    model = program.model.to(device)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [norm.momentum for norm in norms]
    buffers = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}
    was_training = model.training
    try:
        calibrate_batchnorm(model, calibration[:CALIBRATION_SAMPLES].to(device))
        model.eval()
        logits = torch.cat([model(batch.to(device)).cpu() for batch in x.split(512)])
    finally:
        model.load_state_dict(buffers, strict=False)
        for norm, momentum in zip(norms, momenta, strict=True):
            norm.momentum = momentum
        model.train(was_training)
    y = y.long()
    accuracy = float((logits.argmax(dim=1) == y).float().mean())
    return ReceivedEvaluation(accuracy, float(F.cross_entropy(logits, y)), len(y))


__all__ = ["evaluate_received"]
