"""The control channel between processes: message schemas (msgpack, signed), authentication,
the orchestrator's pool of workers, heartbeats and process watching."""
