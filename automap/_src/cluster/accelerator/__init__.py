"""Accelerator co-search: the chip's architecture searched with its placement."""
