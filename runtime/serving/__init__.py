"""Rank 0's serving side: the server loop for clients, the orchestrator (the one door into
serving), the scheduler (in-flight batching over KV slots), detokenisation with stop strings,
and the serving metrics kept beside the scheduler."""
