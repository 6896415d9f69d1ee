"""The fedfleet device agent: the flashable runtime that trains a FedHM model on one device.

It depends on torch, numpy, paho-mqtt, pydantic, safetensors, psutil and pyyaml only, and never
imports the coordinator.
"""

__version__ = "0.1.0"
