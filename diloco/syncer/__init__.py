"""The syncer: merges fragment deltas from islands with an outer Nesterov optimizer."""
