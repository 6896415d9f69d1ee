"""fleet.yaml ``evaluation``: where the global model is measured, for coordinators with and without data."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, StrictBool


class EvaluationSettings(BaseModel):
    """``server``: evaluate on the coordinator's own test split after every round.

    Off, the coordinator needs no test data: the round's figure is the devices' federated evaluation
    (each measures the model it received on its own test shard), which is always collected.
    """

    model_config = ConfigDict(extra="forbid")

    server: StrictBool = Field(
        True, description="evaluate the global model on the coordinator's test split (static BN on its train split)"
    )
    max_samples: PositiveInt | None = Field(
        None,
        description="evaluate on at most this many test images, one seeded draw (dataset.seed) kept for the whole "
        "run so rounds stay comparable; default all (resnet9 on 10,000 CIFAR images took 110 s a round on a CPU); "
        "each device's evaluation of its test share too (its kit's data.test_samples)",
    )


__all__ = ["EvaluationSettings"]
