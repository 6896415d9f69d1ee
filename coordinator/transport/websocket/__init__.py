"""The coordinator's half of the ``websocket`` transport: the server devices dial and the engine's Link on it."""
