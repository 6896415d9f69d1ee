"""The fedfleet coordinator: fleet config, planning, strategies, rounds, broker management, CLI."""
