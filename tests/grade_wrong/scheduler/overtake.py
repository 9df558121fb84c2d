"""Catches: on a small pool, each step is pagedlib's: the newest preempted, queued first; no overtaking

Admission skips a request that does not fit and admits a later one that does (pagedlib stops at the first)."""

from collections import deque


class Scheduler:
    def __init__(self, num_blocks, block_size, max_seqs):
        self.free, self.block_size, self.max_seqs = num_blocks, block_size, max_seqs
        self.requests = {}  # req_id -> [prompt_len, max_new_tokens, tokens made, blocks held]
        self.waiting, self.running = deque(), []

    def add(self, req_id, prompt_len, max_new_tokens):
        self.requests[req_id] = [prompt_len, max_new_tokens, 0, 0]
        self.waiting.append(req_id)

    def blocks_held(self, req_id):
        return self.requests[req_id][3] if req_id in self.requests else 0

    def need(self, req_id):  # new blocks to hold its prompt and every token made
        prompt_len, _, made, held = self.requests[req_id]
        return -(-(prompt_len + made) // self.block_size) - held

    def take(self, req_id, scheduled):
        self.free -= self.need(req_id)
        self.requests[req_id][3] += self.need(req_id)
        scheduled.append(req_id)

    def step(self):
        scheduled, preempted = [], []
        for req_id in list(self.running):
            while req_id in self.running and self.need(req_id) > self.free:
                victim = self.running.pop()
                self.free += self.requests[victim][3]
                self.requests[victim][3] = 0
                self.waiting.appendleft(victim)
                preempted.append(victim)
            if req_id not in self.running:
                break
            self.take(req_id, scheduled)
        for req_id in list(self.waiting):
            if preempted or len(self.running) >= self.max_seqs:
                break
            if self.need(req_id) <= self.free:
                self.waiting.remove(req_id)
                self.running.append(req_id)
                self.take(req_id, scheduled)
        for req_id in scheduled:
            request = self.requests[req_id]
            request[2] += 1
            if request[2] == request[1]:
                self.running.remove(req_id)
                self.free += request[3]
                del self.requests[req_id]
        return scheduled, preempted
