"""fleet.yaml ``evaluation``: where the global model is measured, for coordinators with and without data."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from device_agent.data.datasets import LabeledData

if TYPE_CHECKING:
    from coordinator.config.fleet import Fleet


class EvaluationSettings(BaseModel):
    """``server``: evaluate on the coordinator's own test split after every round.

    Off, the coordinator needs no test data: the round's figure is the devices' federated evaluation
    (each measures the model it received on its own test shard), which is always collected.
    """

    model_config = ConfigDict(extra="forbid")

    server: StrictBool = Field(
        True, description="evaluate the global model on the coordinator's test split (static BN on its train split)"
    )


def no_server_data(fleet: Fleet) -> LabeledData | None:
    """Empty data for a coordinator that needs none, else None (load the data set).

    It needs none when it does not evaluate and fleet.yaml gives the input shape (``model.in_channels``
    and ``model.image_size``), which it would otherwise read off the data set.
    """
    model = fleet.model
    if fleet.evaluation.server or model.in_channels is None or model.image_size is None:
        return None
    images = torch.empty(0, model.in_channels, model.image_size, model.image_size)
    labels = torch.empty(0, dtype=torch.long)
    return LabeledData(images, labels, images, labels, model.num_classes)


__all__ = ["EvaluationSettings", "no_server_data"]
