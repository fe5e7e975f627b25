"""What `peer start` checks before it imports torch and hivemind: the paths it writes, the addresses it
listens on and the form of its --task. Those imports, the task and the DHT take seconds; a typo in any of
these is reported at once, as bad input (exit 2), instead of after them.
"""
from __future__ import annotations

from dht.listen import check_listen_addresses
from monitoring.exporter import MetricsBindError, check_can_listen
from peer.cli.outputs import check_output_paths
from peer.config import PeerConfig
from peer.task_names import check_task_name


def check_before_start(config: PeerConfig) -> None:
    """:raises ValueError: the first problem, in one line naming the flag, the value and the fix"""
    check_output_paths(config.checkpoint.checkpoint_dir, config.logging.summary_json, config.logging.events)
    check_listen_addresses(config.dht.host_maddrs)
    check_task_name(config.training.task)
    if config.monitoring.metrics_port != "off":  # still checked when it starts: the port may be taken meanwhile
        try:
            check_can_listen(config.monitoring.metrics_host, config.monitoring.metrics_port)
        except MetricsBindError as e:
            raise ValueError(e.strerror) from None
