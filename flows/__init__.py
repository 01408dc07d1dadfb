"""kdbench controller: inventory, SSH, Prefect flows, projection, notes, CLI."""
