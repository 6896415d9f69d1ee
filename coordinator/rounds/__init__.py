"""The round core: the engine, the upload gate, signatures, evaluation."""
