"""The server's books: what it holds and counts (sessions and their records, objects, the L1, loans, fence
words, counters, telemetry, the wire formats' encoders, the clear lane) and its typed configuration. Books
import the L2 tiers and the machinery below them, never the request handlers (ops) or the front door."""
