"""The server's plain structures: the key table, LRU queues and indexes, worker threads, heap trimming. They know
nothing of requests, sessions or tiers: they import no other part of the server."""
