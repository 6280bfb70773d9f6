"""Snapshots: when to take one and what goes in (checkpointer), one-file snapshots, their store, format and
check on read (store), sharded snapshots written by every rank with DCP (sharded)."""
