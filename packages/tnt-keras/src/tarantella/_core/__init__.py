"""What every strategy shares: the mesh, the strategy registry, the distributed-model base,
the deferred build, graph walking and the serial-shaped file code (docs/architecture.md)."""
