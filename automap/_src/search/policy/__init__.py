"""The learned policy : features, the network, training and comparison."""
