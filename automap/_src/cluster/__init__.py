"""Cluster planning: layer costs, pipeline placement, execution, accelerator co-search."""
