"""The per-node agent: see README.md."""
