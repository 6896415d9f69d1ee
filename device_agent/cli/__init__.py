"""The ``device-agent`` command line: run, doctor, probe, emulate, worker, infer."""
