"""The L2 tier: where objects evicted from the L1 shared-memory arena go, and where lookups refill L1 from.

    base.py        the `L2Adapter` interface the server's worker threads call, `L2Error`, the key checks
    header.py      the checksummed object header every adapter stores in front of a payload; `crc32`
    specs.py       the registry of kinds (`register_spec`, imported when named), the seed's `--l2-adapter` JSON
                   parsed into a kind's spec; `spec.open()` builds the spec's adapter
    fs_spec.py     `FsL2Spec`: a directory, its capacity, fsync
    fs.py          `FilesystemL2`: one file per object in a local directory; its index, LRU and capacity
    fs_dir.py      that directory: its layout, its lock, every syscall through directory fds, never following a
                   symlink, and the objects found in it on start
    fs_record.py   one object file: header block and payload, written (O_DIRECT) and read back checked
    fs_sync.py     group commit: concurrent durable puts share one syncfs
    redis_spec.py  `RedisL2Spec`: where the store is, its keys, timeouts and secrets
    redis.py       `RedisL2`: objects in a Redis/Valkey shared between hosts
    redis_meta.py  its key names and meta values;  redis_link.py: its clients and the store's health
    redis_known.py what this server knows of the store's objects: their lengths, trusted for a while
    redis_cluster.py  its routing on a Redis Cluster (slots, MOVED / ASK, a node down)

A new kind of L2 is its adapter's module and its spec's module beside it, with one `register_spec` line in specs.py.
"""
