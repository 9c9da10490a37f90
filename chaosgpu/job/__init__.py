"""chaosgpu.job (see docs/ARCHITECTURE.md)."""
