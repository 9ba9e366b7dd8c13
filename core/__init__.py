"""The engine. Kept free of heavy imports: a holder imports ``core.protocol`` through this package."""
