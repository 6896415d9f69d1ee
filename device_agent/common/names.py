"""Names the command line offers before any dependency loads: the standard library alone.

``device-agent --help`` builds every subcommand's parser, and an inference-only install (onnxruntime and
numpy, the agent with ``--no-deps``) has no pydantic or torch, so the choices a parser shows live here.
"""

from __future__ import annotations

from typing import Literal, get_args

DatasetName = Literal["digits", "fashion_mnist", "cifar10", "cifar100", "image_folder", "npz"]
DATASETS: tuple[str, ...] = get_args(DatasetName)

# The variable an emulated agent reads its broker password from unless told otherwise.
PASSWORD_ENV = "FEDFLEET_PASSWORD"

# The index of torch's CPU builds (no NVIDIA packages); the kits' install.sh uses the same one.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
