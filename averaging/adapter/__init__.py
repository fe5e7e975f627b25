"""The hivemind adapter: the only door to hivemind's internals.

Every patch, override and copy of hivemind code is here, each in a small module named for what it changes,
and everything it relies on is fingerprinted (upstream.py), so that an upgrade of hivemind fails loudly.
Nothing outside this package imports hivemind's private modules or touches private attributes of hivemind
objects (import-linter and tests/meta/test_layout.py check it), with one exception named in that test:
dht/sockets.py sets P2P._UNIX_SOCKET_PREFIX (dht/ lies below this package in the layers, and hivemind has no
parameter for it). `install()` puts the patches in place; it runs before any averager process forks. The
modules split out of the former averaging/hivemind_compat.py keep their history there.

- upstream.py: the pinned version, the fingerprints of every upstream function we rely on, `changed_upstream()`;
- install.py: `install()`, which checks the version and applies every module's PATCHES;
- numpy2.py: upstream's 8-bit Quantization.extract, fixed for numpy 2;
- pacing.py: matchmaking lookups and state-donor declarations spaced out (200 DHT requests a second to 20);
- recorded_steps.py: every round started in this process is recorded (`open_rounds`), so that a leaving peer
  can drop the rounds nobody will join;
- epoch_keys.py: every round gathers the epoch it leads to and looks for a group under a key that names it, so
  that peers of different epochs never average together (`round_epoch` reads it back from a round);
- progress_filter.py: a progress tracker reads only the progress records its ClaimFilter believes;
- late_stores.py: DHT stores hivemind fires and never awaits have their timeouts retrieved (no asyncio noise);
- codec_registry.py: our codecs' wire ids, taught to hivemind's decoder;
- allreduce.py: the round pipeline (averaging/pipeline/) driven inside each averager's all-reduce;
- runner.py: canonical replies (every peer of a group takes the same bytes of each part's average);
- grace.py: the grace window of every reducer (a late sender is left out of the round and still gets its
  average), a finished round that still answers its latecomers, and load balancing that never leaves a group
  without a reducer;
- reducer.py: the robust reducer and all-reduce runner (hivemind's, screening each sender's part);
- partition.py: error feedback's part container (hivemind's, over tensors plus residuals);
- refusals.py: excluded peers refused in matchmaking and state sharing;
- process_locks.py: hivemind's process-wide locks made anew in a peer forked from a parent that imported it
  (`peer swarm`), so that peers never share them;
- optimizer.py, state_averager.py: hivemind's Optimizer and TrainingStateAverager, with the overrides our
  strategies need (averaging/strategies/).
"""
from averaging.adapter.epoch_keys import round_epoch
from averaging.adapter.install import install
from averaging.adapter.process_locks import make_own_locks
from averaging.adapter.recorded_steps import open_rounds
from averaging.adapter.upstream import PINNED_VERSION, UPSTREAM, HivemindIncompatible, changed_upstream

__all__ = ["PINNED_VERSION", "UPSTREAM", "HivemindIncompatible", "changed_upstream", "install", "make_own_locks",
           "open_rounds", "round_epoch"]
