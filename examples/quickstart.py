"""Quick start: start a cache server, store a prompt's KV cache, look it up, retrieve it into other
blocks, check every byte, close. Runs on CPU in a few seconds (`python examples/quickstart.py`);
with a GPU, set DEVICE = "cuda" and the same calls move pages between the GPU and the server's arena.
"""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import torch
from hybridkv.engine.transfer import KVTransfer, TransferConfig
from hybridkv.model.presets import preset_layout
from hybridkv.server.books.config import GIB, ServerConfig
from hybridkv.server.front.launch import start_server

DEVICE = "cpu"
NUM_BLOCKS = 64  # blocks in the engine's paged cache, per group


def main() -> None:
    """Store a 3-chunk prompt, then resume it into fresh blocks and compare every page."""
    # A tiny hybrid model: attention groups and Gated DeltaNet (recurrent) groups, pages of a few KiB.
    layout = preset_layout("tiny-hybrid")
    # The engine's paged cache: per group, per layer, one page per block (vLLM's layout of a hybrid cache).
    pages = [[torch.randint(0, 256, (NUM_BLOCKS, g.page_bytes), dtype=torch.uint8, device=DEVICE)
              for _ in range(g.num_layers)] for g in layout.groups]

    sock_dir = tempfile.mkdtemp(prefix="hybridkv-quickstart-")  # 0700: the server refuses an open directory
    # its own process, ready on return
    server = start_server(ServerConfig(endpoint=f"ipc://{sock_dir}/server.sock", l1_bytes=GIB // 16))
    try:
        with KVTransfer(server.endpoint, layout, pages, TransferConfig(wire_format="shm")) as kv:
            chunk = kv.chunk_tokens  # the cache unit: a prefix is cached in whole chunks
            tokens = np.random.default_rng(0).integers(0, 150_000, 3 * chunk + 5)  # 3 full chunks + a tail
            per_chunk = [chunk // g.block_tokens for g in layout.groups]  # blocks of one chunk, per group

            # The prompt's blocks, per group: blocks 0.. of each group hold its pages.
            src = [list(range(3 * n)) for n in per_chunk]
            kv.store("req-1", tokens, src).wait_committed(30)  # done: blocks reusable; committed: visible
            kv.end_session("req-1")

            hit = kv.lookup("req-2", tokens)  # the longest prefix resumable exactly (state included)
            print(f"lookup: {hit.hit_tokens} of {len(tokens)} tokens cached ({hit.hit_chunks} chunks, "
                  f"{hit.nbytes:,} bytes to load)")
            dst = [list(range(3 * n, 6 * n)) for n in per_chunk]  # other blocks, as a new request gets
            kv.retrieve(hit, dst).wait(30)  # pages written before the engine's next use
            kv.end_session("req-2")

            # Attention groups get every block of the hit; recurrent groups the state at its last chunk.
            checked = 0
            for g, group in enumerate(layout.groups):
                blocks = range(3 * per_chunk[g]) if group.kind == "attention" else [3 * per_chunk[g] - 1]
                for layer in pages[g]:
                    for b in blocks:
                        assert torch.equal(layer[dst[g][b]], layer[src[g][b]]), (g, b)
                        checked += 1
            print(f"retrieve: {checked} pages identical to the stored ones")
    finally:
        server.stop()  # SIGTERM: the server removes its arena and socket
        server.close()
        shutil.rmtree(sock_dir, ignore_errors=True)
    print(f"server stopped; its arena {server.arena_path} is gone")


if __name__ == "__main__":
    main()
