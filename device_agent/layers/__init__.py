"""Every layer parametrization the strategies train: FedHM factorized/hybrid, rank-one + sparse, LoRA, regularizers."""

from device_agent.layers.rank_one import (
    LAYOUTS,
    Layout,
    RankOneLayer,
    dense_state,
    l1_on_mu,
    rank_one_layers,
    reparametrize,
    similarity_layer,
)

__all__ = [
    "LAYOUTS",
    "Layout",
    "RankOneLayer",
    "dense_state",
    "l1_on_mu",
    "rank_one_layers",
    "reparametrize",
    "similarity_layer",
]
