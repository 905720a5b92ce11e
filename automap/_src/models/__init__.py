"""Reference models: the programs the demo, tests and benchmarks partition."""
