"""Device classes as YAML data, their catalog, and the cost model that predicts a level's memory and time."""
