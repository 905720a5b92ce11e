"""Execution: cutting a program into stages and running a plan."""
