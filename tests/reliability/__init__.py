"""Reliability tests: real swarms under faults, churn, full disks and hostile peers (integration)."""
