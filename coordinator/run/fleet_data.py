"""What the coordinator itself holds of a fleet's data: the model spec and its held-out split."""

from __future__ import annotations

from dataclasses import replace

import torch

from coordinator.config.fleet import Fleet
from coordinator.strategies import ModelSpec
from device_agent.data.datasets import LabeledData, load_dataset, source_of
from device_agent.models import model_card


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


def fleet_data(fleet: Fleet) -> tuple[ModelSpec, LabeledData]:
    """The model spec and the coordinator's copy of the data (held-out test split + BN calibration).

    Images come at ``model.image_size``, else at the card's size for a model that takes no other
    (a ViT), else at the data set's own size.
    """
    source = source_of(fleet.dataset.name, fleet.dataset.path)
    card = model_card(fleet.model.arch)
    size = fleet.model.image_size or (card.image_size if card.fixed_size else None)
    data = no_server_data(fleet) or load_dataset(source, size, fleet.model.in_channels)
    data = evaluation_subset(data, fleet.evaluation.max_samples, fleet.dataset.seed)
    return ModelSpec(fleet.model.arch, fleet.model.num_classes, data.in_channels, data.image_size), data


def evaluation_subset(data: LabeledData, max_samples: int | None, seed: int) -> LabeledData:
    """``data`` with at most ``max_samples`` test images (fleet.yaml ``evaluation.max_samples``).

    One seeded draw, in the split's order: the same images every round and on every resume.
    """
    if max_samples is None or len(data.test_y) <= max_samples:
        return data
    keep = torch.randperm(len(data.test_y), generator=torch.Generator().manual_seed(seed))[:max_samples].sort().values
    return replace(data, test_x=data.test_x[keep], test_y=data.test_y[keep])


__all__ = ["evaluation_subset", "fleet_data", "no_server_data"]
