"""A fleet on one host: in-process simulation and emulation with real agent processes."""
