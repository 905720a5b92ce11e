"""Plans: the searched layouts, their per-layer report, text, export and cache."""
