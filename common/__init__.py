"""computerrl common, the ground floor every role stands on: the wire protocol and links, configs, logs, metrics, the
run directory, the audit trail, the rules broker and learner share, screenshots by content hash. No torch at module
level (a broker or env_server never loads it; the model side is ``policy/``)."""
