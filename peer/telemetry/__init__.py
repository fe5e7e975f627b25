"""What a peer reports, and to whom: logs.py (plain or JSON log lines), console.py (the bar and a line per
epoch), events.py (the events file, for programs), reports.py (what the training loop reports),
observers.py (those reports to the metrics and the events file), summary.py (the summary written at exit)."""
