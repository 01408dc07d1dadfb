"""The inventory (hosts/*.yaml, spec sheets, pinned host keys) and what of it may never leave the controller."""
