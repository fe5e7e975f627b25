"""The `peer` command line: main.py (the click group), entry.py (the console script), options.py (flags generated
from the config models), preflight.py and outputs.py (bad input caught before torch is imported), and one module
per command: start.py, bootstrap.py, status.py, monitor.py, swarm.py."""
