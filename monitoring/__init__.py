"""Monitoring: phase timing, metrics and bottleneck classification. Imports nothing of ours."""
from monitoring.phases import CATEGORIES, CATEGORY_OF_PHASE, PHASES, PhaseTimer

__all__ = ["CATEGORIES", "CATEGORY_OF_PHASE", "PHASES", "PhaseTimer"]
