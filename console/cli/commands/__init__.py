"""One module per CLI command group; each exposes ``register(app)``."""
