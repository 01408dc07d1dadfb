"""The `kdbench` command: one module per command group; each imports what it needs when it runs."""
