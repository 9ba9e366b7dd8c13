"""Console screens."""
