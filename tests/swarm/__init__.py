"""Swarm tests: real `peer start` processes on 127.0.0.1 (integration)."""
