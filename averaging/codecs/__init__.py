"""Codecs: compression.py maps the config's codec names onto hivemind compression and measures payloads;
lowbit.py holds our blockwise int8/int4 codecs, sparse.py our top-k."""
