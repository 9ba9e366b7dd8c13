"""Benchmark studies: the measurement logic; ``console/cli/commands`` holds only their wiring."""
