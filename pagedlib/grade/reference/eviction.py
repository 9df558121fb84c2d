"""pagedlib's answer to task ``eviction``: ``kv_transfer.policies.LRU``, which takes the tier's capacity
(ARC's ghost lists need it; LRU never reads it)."""

from pagedlib.kv_transfer import policies


class LRU(policies.LRU):
    def __init__(self):
        super().__init__(capacity=0)
