"""Local work for one round: the round driver (run_assignment), the optimizer, the local round, federated
evaluation, OOM handling."""
