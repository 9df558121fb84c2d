"""Catches: every answer and the order of the keys equal pagedlib's LRU after any sequence of operations

Finds a key in its line with ``is``, not ``==``: right while keys are ints from -5 to 256 (Python keeps one
object of each), wrong for block hashes, where an equal key is another object."""


class LRU:
    def __init__(self):
        self.line = []                  # the least recent first

    def find(self, key):
        return next((i for i, k in enumerate(self.line) if k is key), None)

    def __contains__(self, key):
        return self.find(key) is not None

    def __len__(self):
        return len(self.line)

    def keys(self):
        return list(self.line)

    def insert(self, key):
        self.line.append(key)

    def remove(self, key):
        del self.line[self.find(key)]

    def touch(self, keys):
        for key in reversed(keys):
            i = self.find(key)
            if i is not None:
                self.line.append(self.line.pop(i))

    def evict(self, n, protected):
        chosen = [key for key in self.line if key not in protected][:n]
        if len(chosen) < n:
            return None
        self.line = [key for key in self.line if key not in chosen]
        return chosen
