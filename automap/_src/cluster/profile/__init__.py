"""Profiling: a program's layers and what each costs."""
