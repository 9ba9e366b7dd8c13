"""Benchmark studies: the measurement logic; ``console/commands`` holds only their wiring."""
