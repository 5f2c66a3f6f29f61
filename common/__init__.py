"""computerrl common: wire protocol, config, logging, ZMQ helpers, metrics (no torch here)."""
