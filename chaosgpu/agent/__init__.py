"""chaosgpu.agent (see docs/ARCHITECTURE.md)."""
