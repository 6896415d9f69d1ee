"""Broker logins that fleet.yaml reserves: the coordinator's own name on the broker and in its ACL."""

COORDINATOR_USER = "coordinator"
"""No device may take this name: the password file and the ACL give it the whole fleet's topics."""
