"""Sharding states over a mesh and their propagation through factor rules."""
