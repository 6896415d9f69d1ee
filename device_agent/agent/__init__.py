"""The agent runtime: config, session use, outbox, probe and signing. Never imports emulation."""
