"""One process per device: the worker process (`process`) holding the draft shard, the
target shard or both (`shards`), and one speculation round as plain functions (`round`)."""
