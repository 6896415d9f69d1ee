"""ONNX export of a run's models with onnxruntime parity and latency checks (flash bundles: not built yet).

Imports device_agent only; the coordinator hands it a run as :class:`export.targets.TrainedRun`.
"""
