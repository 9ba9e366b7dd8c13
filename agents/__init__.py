"""Holder agents and their deployment."""
