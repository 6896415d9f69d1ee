"""The built-in transports; each module registers one in :data:`coordinator.transport.registry.TRANSPORTS`."""
