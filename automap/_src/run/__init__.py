"""Running a plan: the partitioned program, and checks of it against XLA."""
