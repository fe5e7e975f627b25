"""dht: starting hivemind's DHT (node.py, listen.py, sockets.py), identity and bootstrap (identity.py,
config.py, files.py), the key registry (keys.py, swarm_key.py) and signed, typed swarm records (records.py,
manifest.py, clock.py). It imports nothing of ours."""
