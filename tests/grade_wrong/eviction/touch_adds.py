"""Catches: the host tier on your policy finds, stores and evicts the blocks it does on pagedlib's

touch adds the keys it does not hold, so the policy comes to hold keys the tier has no slot for (a
finished request touches keys already evicted)."""


class LRU:
    def __init__(self):
        self.line = {}

    def __contains__(self, key):
        return key in self.line

    def __len__(self):
        return len(self.line)

    def keys(self):
        return list(self.line)

    def insert(self, key):
        self.line[key] = None

    def remove(self, key):
        del self.line[key]

    def touch(self, keys):
        for key in reversed(keys):
            self.line.pop(key, None)
            self.line[key] = None

    def evict(self, n, protected):
        chosen = [key for key in self.line if key not in protected][:n]
        if len(chosen) < n:
            return None
        for key in chosen:
            del self.line[key]
        return chosen
