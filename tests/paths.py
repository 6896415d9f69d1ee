"""Where the repository's files are, for tests at any depth of the tests/ tree."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
