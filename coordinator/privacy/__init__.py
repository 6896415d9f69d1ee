"""User-level differential privacy as a layer of the round (DP-FedAvg, McMahan et al. 2018): the device clips its
whole contribution (``device_agent.training.clipping``), the coordinator aggregates uniformly, adds Gaussian noise
once where the sum is formed (:mod:`.layer`), adapts the clip norm (:mod:`.adaptive`) and keeps the accountant in
the run state (:mod:`.accountant`). The derivation is in docs/privacy.md."""
