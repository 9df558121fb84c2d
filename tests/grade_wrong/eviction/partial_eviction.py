"""Catches: an eviction that cannot free n blocks returns None and changes nothing

Evicts the unprotected keys it finds before it sees there are too few, then returns None: the tier
refuses the store but has lost those blocks."""


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
            if key in self.line:
                del self.line[key]
                self.line[key] = None

    def evict(self, n, protected):
        chosen = []
        for key in list(self.line):
            if len(chosen) < n and key not in protected:
                del self.line[key]
                chosen.append(key)
        if len(chosen) < n:
            return None
        return chosen
