"""The serving simulation of notebook 07: seeded workloads (``workloads``) and ``simulate`` (``simulate``),
which drives the real scheduler and accounts for every slot of the KV budget."""
