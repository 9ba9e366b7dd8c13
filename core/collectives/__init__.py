"""Secure collective communication: an encrypted ring all-reduce and a DDP comm hook."""
