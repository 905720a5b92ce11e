"""Plans: the searched layouts made into plans, their per-layer report, text, export and cache."""
