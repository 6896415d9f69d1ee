"""The bottom layer shared by agent and coordinator: schemas, atomic files, paths."""
