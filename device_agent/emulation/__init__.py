"""Holding agents to device profiles: limits, shaping, packing, launcher, workers."""
