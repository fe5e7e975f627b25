"""Process hygiene: lifeline.py makes every child die with the peer, signals.py turns SIGINT and SIGTERM into a
graceful stop, and launcher.py starts and supervises `peer` processes for `peer swarm` and the test harness."""
