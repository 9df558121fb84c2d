"""The serving simulation of notebook 07: seeded workloads and ``simulate`` over the real scheduler."""
