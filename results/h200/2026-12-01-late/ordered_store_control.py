"""The negative control of tests/engine/test_transfer_order.py::test_a_store_ordered_on_the_engine_stream_is_read_
before_later_writes: the same store and overwrite (the test's own function), with and without making the engine's
stream wait for the store's copies. Prints the stored pages that hold the later writes, per layout and mode.
(The run committed beside this file used an inline copy of that function, tree f1d5565.)"""

import sys
import tempfile
from pathlib import Path

from hybridkv.server.books.config import ServerConfig
from hybridkv.server.front.launch import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "reference_impl" / "tests" / "engine"))
from test_transfer_order import ordered_store_wrong_pages  # noqa: E402

d = tempfile.mkdtemp(prefix="hkv-", dir="/tmp")
srv = start_server(ServerConfig(endpoint=f"ipc://{d}/s.sock", l1_bytes=2 << 30))
try:
    for preset, tp in (("tiny-hybrid", 1), ("qwen3.6-27b", 8)):
        for ordered in (False, True):
            wrong, total = ordered_store_wrong_pages(srv.endpoint, preset, tp, ordered)
            print(f"{preset} tp{tp} ordered={ordered}: {wrong} of {total} stored pages hold the later writes")
finally:
    srv.close()
