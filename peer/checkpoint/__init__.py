"""Durability: store.py writes checkpoints atomically and reads back the newest intact one; lock.py keeps one
peer per checkpoint directory."""
