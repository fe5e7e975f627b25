"""strategies: one module per averaging strategy (averaging/registry.py names each one's builder), and what they share.

- factory.py, parts.py: what every strategy is built with, and the call of the registered builder;
- membership.py: what the strategies implement alike of the Protocols (averaging/api.py);
- rounds.py: the round bookkeeping they share (outcomes, resyncs, deadlines, state downloads);
- outer.py: DiLoCo's outer round (diloco.py), the all-reduce of pseudo-gradients and the outer Nesterov step.
"""
