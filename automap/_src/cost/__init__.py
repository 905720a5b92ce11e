"""The cost model: device figures, compiler behaviour, collectives, pricing."""
