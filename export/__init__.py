"""ONNX export of a run's models (merged, per ratio, personalized) with onnxruntime parity and latency checks.

Imports device_agent only; the coordinator hands it a run as :class:`export.targets.TrainedRun`.
"""
