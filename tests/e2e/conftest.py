"""The exported-model fixtures of tests/export, for the e2e tests that run an export in another venv."""

from tests.export.conftest import cnn_export, cnn_run

__all__ = ["cnn_export", "cnn_run"]
