"""chaosgpu.k8s (see docs/ARCHITECTURE.md)."""
