"""The program as automap sees it: trace, graph, factor rules, layer names and groups."""
