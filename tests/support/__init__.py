"""The shared test library: synthetic runs written through engine.schema (runs: H200-shaped kernel and
model-level runs, the old store layout; stepmodel: a k2-mini run built from a known step model) and
reading rendered pages back (sections). Fixtures are in conftest.py."""
