"""One process per device: the worker process (`process`; its end of the control plane
`control_link`, its serving of the step commands `dispatch`) holding the draft shard, the
target shard or both (`shards`), and one speculation round as plain functions (`round`)."""
