"""The syncer's core: the protocol's rules with no I/O (events in, effects out)."""
