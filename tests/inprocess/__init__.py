"""In-process tests: real hivemind DHTs and averagers in this process, on 127.0.0.1."""
