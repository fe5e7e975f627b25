"""What a peer knows of the swarm: progress.py (hivemind's progress tracker as a SwarmView), claims.py (which
progress records to believe), donor.py (how this peer ranks as a state donor), open_rounds.py (rounds nobody
will join, dropped by a leaving peer)."""
