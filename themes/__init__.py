"""Textual themes (.tcss)."""
