"""averaging: how peers average, on hivemind. It may import dht, and nothing else of ours.

- api.py: what the training loop and the swarm session may ask of a strategy, and plain data;
- config.py: AveragingConfig, checked at load time without importing torch or hivemind;
- registry.py: every strategy declared once (name, help, config section, shared settings, payload, builder);
- deadlines.py: adaptive matchmaking time and averaging timeout;
- strategies/: the averaging strategies and how one is built;
- pipeline/: what happens to a contribution in a round: error feedback, robust reduction, exclusion,
  completeness, guards against non-finite values;
- codecs/: codec names mapped to hivemind compression, our low-bit codecs, payload accounting;
- swarm/: what a peer knows of the swarm: progress records and which to believe, donors, open rounds;
- adapter/: the only door to hivemind's internals (every patch and override, fingerprinted).
"""
