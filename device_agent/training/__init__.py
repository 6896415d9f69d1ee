"""Local work for one round: the optimizer, the local round, federated evaluation, OOM handling."""
