"""The test oracle: the hit, in chunks, that one engine namespace must get, given the prompts it stored.

From the prompts an engine namespace stored, `ExpectedHits` applies DESIGN.md's hit rule (attention for
every chunk of the prefix, recurrent state at its last chunk; every group of every chunk when the retrieve
policy is `all`) under the case's store policy. The runner fails a case whose server answers anything else.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np


class ExpectedHits:
    """The hit, in chunks, that one engine namespace must get, given the prompts it stored."""

    def __init__(self, chunk_tokens: int, has_state: bool, store_policy: str, retrieve_policy: str):
        self.chunk_tokens = chunk_tokens
        self.has_state = has_state
        self.store_policy = store_policy
        self.retrieve_policy = retrieve_policy
        self._attention: set[bytes] = set()
        self._state: set[bytes] = set()
        self._lock = threading.Lock()

    def prefixes(self, tokens: np.ndarray) -> list[bytes]:
        """One id per full chunk of `tokens`, naming the whole prefix up to that chunk's end."""
        data = np.asarray(tokens, "<u4").tobytes()
        step, out, prev = 4 * self.chunk_tokens, [], b""
        for off in range(0, len(data) - step + 1, step):
            prev = hashlib.blake2b(prev + data[off:off + step], digest_size=16).digest()
            out.append(prev)
        return out

    def shared(self, tokens: np.ndarray) -> int:
        """The whole chunks `tokens` shares with what was stored (every stored prompt's attention): what an
        attention-only model would resume from, and so the most a hit can be."""
        ids = self.prefixes(tokens)
        with self._lock:
            n = 0
            while n < len(ids) and ids[n] in self._attention:
                n += 1
            return n

    def lookup(self, tokens: np.ndarray) -> int:
        ids = self.prefixes(tokens)
        with self._lock:
            full = 0
            for p in ids:
                if p not in self._attention or (self.retrieve_policy == "all" and self.has_state
                                                 and p not in self._state):
                    break
                full += 1
            for n in range(full, 0, -1):
                if not self.has_state or ids[n - 1] in self._state:
                    return n
        return 0

    def stored(self, tokens: np.ndarray) -> None:
        ids = self.prefixes(tokens)
        if not ids:
            return
        with self._lock:
            self._attention.update(ids)
            self._state.update(ids if self.store_policy == "all" else ids[-1:])

    def clear(self) -> None:
        with self._lock:
            self._attention.clear()
            self._state.clear()
