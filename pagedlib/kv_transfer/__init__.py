"""K/V beyond the device pool (notebooks 13, 14), reached by the scheduler through one door, the connector
contract of ``core.connector``:

- ``policies``    the host tier's eviction policies (LRU, ARC) behind one protocol, chosen by name
- ``host_tier``   ``HostCache`` (which keys the tier holds) and ``HostTier`` (its memory and copies)
- ``store``       ``KVStore``: a block a safetensors file, named by a chained token hash, checked
- ``rules``       what a connector offers at admission and saves after a step, written once
- ``connectors``  ``StoreConnector`` (files shared with other engines) and ``HostConnector`` (the host tier)

It imports ``core`` and nothing above it; ``engine`` builds a ``HostConnector`` from ``host_blocks``."""
