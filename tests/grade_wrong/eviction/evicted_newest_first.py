"""Catches: a protected block is never evicted

Evicts the right keys but returns them most recent first, where the tier reads them least recent first."""

class LRU:
    def __init__(self):
        self.line = {}                  # a dict keeps insertion order: the least recent first

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
            if key in self.line:
                del self.line[key]
                self.line[key] = None

    def evict(self, n, protected):
        chosen = [key for key in self.line if key not in protected][:n]
        if len(chosen) < n:
            return None
        for key in chosen:
            del self.line[key]
        return chosen[::-1]
