"""Pure functions of stored tables: kernel families, the step model, projection, bands, backtests, what-if grids, reference data."""
