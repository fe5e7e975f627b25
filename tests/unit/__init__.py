"""Unit tests: no process, no network."""
