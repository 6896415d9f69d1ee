"""The run directory and what is made from it: checkpoints, metrics, report, export."""
