"""The cache server, in layers whose imports run only downwards (tests/test_structure.py holds them to it):

    front/      the loop, its sockets, the command line, launch, logs, the metrics endpoint: the process's edge
    ops/        one module per request, and what handlers share (Context, the hit rule, turns)
    books/      what the server holds and counts: sessions, objects, L1, loans, fences, counters, telemetry, config
    l2/         the L2 tiers below L1 (a directory, Redis / Valkey)
    machinery/  plain structures: the sharded table, LRU queues, worker threads, heap trimming
"""
