"""Durability: store.py writes checkpoints atomically (weights as safetensors, the rest beside them, an index of
digests: parts.py) and reads back the newest intact one; lock.py keeps one peer per checkpoint directory."""
