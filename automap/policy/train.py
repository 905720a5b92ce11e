"""`python -m automap.policy.train`: trains the search policy's weights."""

from automap._src.search.policy.train import main

if __name__ == "__main__":
  main()
