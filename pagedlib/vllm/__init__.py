"""vLLM itself, beside the course's engine (notebooks 12-14), each module run in a child process of its own
or loaded by vLLM:

- ``bridge``     a worker process running vLLM set up like an ``Engine``, stepped on the same requests
- ``connector``  ``PagedlibConnector``: vLLM loads and saves ``KVStore`` entries through it
- ``offload``    vLLM's ``CPUOffloadingManager`` replaying a trace: the oracle of ``HostCache``
- ``hybrid``     vLLM's hybrid ``KVCacheManager`` replaying requests without a model: the oracle of a block
                 table per KV-cache group (notebook 15)

Nothing else in pagedlib imports vLLM: the package runs without it."""
