"""The controller: inventory, transport, store, analysis, notes, the Prefect pipelines and the `kdbench` CLI."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout: hosts/, artifacts/ and docs/ default to its folders
