"""Search over sharding states."""
