from peer.cli.entry import run

run()
