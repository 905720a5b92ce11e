"""`python -m automap.policy.train`: labels a corpus and trains the learned filter."""

from automap._src.search.policy.train import main

if __name__ == "__main__":
  main()
