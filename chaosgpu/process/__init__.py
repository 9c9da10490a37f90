"""chaosgpu.process (see docs/ARCHITECTURE.md)."""
