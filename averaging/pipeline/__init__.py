"""The round pipeline (round_pipeline.py) and its stages: error_feedback.py, defence.py (robust reduction and
the excluded peers) with robust.py (the rules a reducer applies) and exclusion.py (who is excluded), and
completeness.py (whether a round delivered the whole average); guards.py keeps non-finite values out of rounds
and models. Nothing here touches hivemind internals: averaging/adapter/ drives the stages inside hivemind."""
