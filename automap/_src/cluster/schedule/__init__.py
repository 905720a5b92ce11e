"""Pipeline schedules: the order each stage runs its work in."""
