"""ONNX export, onnxruntime parity/latency checks and flash bundles for devices (not built yet)."""
