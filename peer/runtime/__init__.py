"""A running peer: builder.py assembles it from its config and takes it apart in reverse order on every path;
trainer.py is the training loop, and tally.py where its optimizer's reports go; session.py and leaving.py are its
membership in the swarm (the start gate, catching up, leaving at --max-epochs); manifest.py checks the run manifest
before the first step; resume.py restores a checkpoint; device.py and precision.py choose where and in what
precision it trains; pausing.py, pauser.py, parking.py and busy.py pause and resume it (peer pause, --active-hours,
--yield-when-busy); credit.py keeps what it gave and what it saw others give."""
