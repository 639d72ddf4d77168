"""worker: one model shard -- model code, attention backends, sampling and the runner."""
