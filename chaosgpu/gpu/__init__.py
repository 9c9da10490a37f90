"""chaosgpu.gpu (see docs/ARCHITECTURE.md)."""
