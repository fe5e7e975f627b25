"""peer: the daemon itself, the composition root that may import every other package.

- config.py: PeerConfig (one sub-config per package) and the one function that resolves it;
- cli/: the `peer` commands (start, bootstrap, status, monitor, swarm, pause, resume, export), their options and the
  checks made before torch and hivemind are imported;
- runtime/: assembling a peer (builder.py), the training loop, membership in the swarm (joining, leaving),
  the run manifest, device and precision;
- checkpoint/: checkpoints written atomically (weights as safetensors), and the lock that keeps one peer per directory;
- tasks/: what a peer trains (the Task interface, the built-in tasks, `module:function` loading, data loaders);
- telemetry/: what a peer reports: logs, the console, the events file, metrics observers, the exit summary;
- process/: process hygiene (children die with the peer, signals) and the launcher of `peer` processes;
- testing/: the asyncio harness and the fault injector that tests and benchmarks use;
- exit_codes.py, task_names.py, version.py: small leaves every room may use.
"""
