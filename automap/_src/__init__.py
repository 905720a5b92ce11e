"""automap internals; the public API is re-exported by `automap`."""
