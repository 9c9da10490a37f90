"""chaosgpu.node (see docs/ARCHITECTURE.md)."""
