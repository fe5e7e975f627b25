"""Tests of the repository itself: layout, docs, help, bad input, deploy files."""
