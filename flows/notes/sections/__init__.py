"""The sections of a host page and the fleet index: gathered views in, page views (flows.notes.pages) and
their charts (flows.notes.plots) out."""
