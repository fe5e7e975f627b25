from peer.entry import run

run()
