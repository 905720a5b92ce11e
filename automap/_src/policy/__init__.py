"""The learned policy (see automap._src.policy)."""
