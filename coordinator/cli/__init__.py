"""The ``coordinator`` command line: one module per command group; imports anything."""
