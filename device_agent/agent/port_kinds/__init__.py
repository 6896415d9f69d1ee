"""The built-in port kinds; each module registers its own in :data:`device_agent.agent.ports.PORTS`."""
