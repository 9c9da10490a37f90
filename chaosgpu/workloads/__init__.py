"""chaosgpu.workloads (see docs/ARCHITECTURE.md)."""
