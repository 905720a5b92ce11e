"""Placement: pricing stages and choosing the cluster's layout."""
