"""chaosgpu.report (see docs/ARCHITECTURE.md)."""
