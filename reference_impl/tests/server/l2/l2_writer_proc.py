"""A process that puts objects into a FilesystemL2 until it is killed (the crash test's victim).

    python l2_writer_proc.py DIRECTORY FIRST_INDEX SIZES MAX_OBJECTS

Object i has key `object_key(i)`, group i % 3 and `object_size(i, sizes)` payload bytes from
`object_payload`, so the test recomputes every byte without being told. For each object it prints
`begin i` before the put and `done i` once the put has returned, flushing each line: a `done` line
is the writer's acknowledgement, the promise the test holds the store to after a SIGKILL. It stops
by itself after MAX_OBJECTS puts, so a test that dies before killing it does not fill the disk.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

NS = b"l2-crash-test-ns"  # 16 bytes
CAPACITY_BYTES = 1 << 40  # never evicts: every acknowledged object must still be there


def object_key(i: int) -> bytes:
    """The 16-byte key of object i."""
    return hashlib.blake2b(f"l2-crash-object-{i}".encode(), digest_size=16).digest()


def object_group(i: int) -> int:
    """The group of object i."""
    return i % 3


def object_size(i: int, sizes: list[int]) -> int:
    """The payload length of object i: cycles through `sizes`."""
    return sizes[i % len(sizes)]


def object_payload(key: bytes, size: int) -> bytes:
    """Payload bytes derived from the key alone (random-looking, never a run of zeros)."""
    return np.random.default_rng(int.from_bytes(key, "little")).bytes(size)


def main(argv: list[str]) -> None:
    from hybridkv.server.l2.fs import FilesystemL2

    directory, first = argv[0], int(argv[1])
    sizes = [int(s) for s in argv[2].split(",")]
    l2 = FilesystemL2(directory, CAPACITY_BYTES)
    for i in range(first, first + int(argv[3])):
        key, group = object_key(i), object_group(i)
        data = object_payload(key, object_size(i, sizes))
        print(f"begin {i}", flush=True)
        l2.put(key, group, NS, data)
        print(f"done {i}", flush=True)
    l2.close()


if __name__ == "__main__":
    main(sys.argv[1:])
