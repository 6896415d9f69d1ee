"""fleet.yaml and its sections: the validated configuration a run starts from."""
