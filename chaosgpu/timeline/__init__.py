"""chaosgpu.timeline (see docs/ARCHITECTURE.md)."""
