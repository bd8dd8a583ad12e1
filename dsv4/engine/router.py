"""Session affinity across engine replicas: a session always lands on the same replica.

Agentic traffic resends a growing conversation every turn; its prefix is cached on the replica that
served the previous turn, so the router hashes session ids onto a ring of virtual nodes (consistent
hashing: adding or removing a replica moves only the sessions that hashed to it). Requests without a
session go to the replica with the fewest requests in flight.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class ConsistentHashRing:
    def __init__(self, replicas: Sequence[str], virtual_nodes: int = 64):
        if not replicas:
            raise ValueError("a ring needs at least one replica")
        self._ring = sorted((_point(f"{name}#{v}"), name) for name in replicas for v in range(virtual_nodes))
        self._keys = [p for p, _ in self._ring]

    def lookup(self, session_id: str) -> str:
        i = bisect.bisect(self._keys, _point(session_id)) % len(self._ring)
        return self._ring[i][1]


class Replicas:
    """Several engines behind one `generate`: each prompt goes to its session's replica."""

    def __init__(self, engines: dict[str, object], virtual_nodes: int = 64):
        self.engines = dict(engines)
        self.ring = ConsistentHashRing(list(self.engines), virtual_nodes)
        self._load = dict.fromkeys(self.engines, 0)

    def replica_for(self, session_id: str | None) -> str:
        if session_id is None:
            return min(self._load, key=self._load.get)
        return self.ring.lookup(session_id)

    def generate(self, prompts, sampling_params=None, session_ids=None):
        prompts = list(prompts)
        sessions = list(session_ids) if session_ids is not None else [None] * len(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        outputs = [None] * len(prompts)
        by_replica: dict[str, list[int]] = {}
        for i, session in enumerate(sessions):
            name = self.replica_for(session)
            by_replica.setdefault(name, []).append(i)
            self._load[name] += 1
        for name, indices in by_replica.items():
            results = self.engines[name].generate(
                [prompts[i] for i in indices], [params[i] for i in indices], [sessions[i] for i in indices]
            )
            for i, out in zip(indices, results):
                outputs[i] = out
                self._load[name] -= 1
        return outputs
