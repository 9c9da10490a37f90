"""chaosgpu.sandbox (see docs/ARCHITECTURE.md)."""
