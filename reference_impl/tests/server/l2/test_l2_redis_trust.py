"""A shared Redis L2 that strangers cannot use or write: AUTH from a file or an environment variable, and an
HMAC over every object, against real redis-server processes (issue 23)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import zlib

import pytest
import rediskit
from hybridkv.server.l2.base import L2Error
from hybridkv.server.l2.header import HEADER_BYTES, ObjectHeader
from hybridkv.server.l2.specs import L2ConfigError, parse_l2_adapter

pytestmark = pytest.mark.skipif(rediskit.skip_reason() is not None, reason=str(rediskit.skip_reason()))

NS = b"namespace-a-0001"
KEY = bytes(range(16))


def secret_file(tmp_path, name: str, data: bytes, mode: int = 0o600) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def adapter(url: str, env: dict[str, str] | None = None, **extra: object):
    import json

    from hybridkv.server.l2.redis import RedisL2

    return RedisL2(parse_l2_adapter(json.dumps({"type": "redis", "url": url, "chunk_mb": 0.25, **extra}), env or {}))


def read_back(l2, key: bytes, n: int) -> bytes | None:
    out = bytearray(n)
    return bytes(out) if l2.get_into(key, 0, memoryview(out)) else None


@pytest.fixture
def locked_store():
    r = rediskit.RedisProcess(password="s3cret-for-the-test")
    yield r
    r.close()


def test_auth_takes_the_password_from_a_file_or_an_environment_variable(locked_store, tmp_path):
    data = random.Random(1).randbytes(300_000)
    pw = secret_file(tmp_path, "pw", b"s3cret-for-the-test\n")
    with adapter(locked_store.url, password_file=pw) as l2:
        l2.put(KEY, 0, NS, data)
        assert read_back(l2, KEY, len(data)) == data
    env = {"HKV_TEST_REDIS_PW": "s3cret-for-the-test"}  # the environment the edge passes down
    with adapter(locked_store.url, env, password_env="HKV_TEST_REDIS_PW") as l2:
        assert read_back(l2, KEY, len(data)) == data
        assert "s3cret" not in repr(l2.spec)
    with adapter(locked_store.url) as stranger:  # no password: the store refuses it, which is misses
        assert read_back(stranger, KEY, len(data)) is None
        with pytest.raises(L2Error):
            stranger.put(KEY, 1, NS, data)


@pytest.mark.parametrize("extra, says", [
    ({"password": "s3cret"}, "takes no password"),
    ({"url": "redis://:s3cret@127.0.0.1:6379/0"}, "carries a password"),
    ({"password_file": "{tmp}/open"}, "chmod 600"),
    ({"password_file": "{tmp}/missing"}, "cannot open"),
    ({"password_env": "HKV_TEST_UNSET_VARIABLE"}, "not set"),
    ({"mac_key_file": "{tmp}/short"}, "at least 16"),
])
def test_secrets_on_the_command_line_or_open_to_others_are_refused(tmp_path, extra, says):
    import json

    secret_file(tmp_path, "open", b"s3cret", mode=0o644)
    secret_file(tmp_path, "short", b"0123456789")
    spec = {"type": "redis", "url": "redis://127.0.0.1:6379/0", **extra}
    text = json.dumps(spec).replace("{tmp}", str(tmp_path))
    with pytest.raises(L2ConfigError, match=says) as ei:
        parse_l2_adapter(text, {})
    assert "s3cret" not in str(ei.value)


@pytest.fixture
def store():
    r = rediskit.RedisProcess()
    yield r
    r.close()


def test_with_a_mac_key_only_objects_of_key_holders_are_served(store, tmp_path):
    """A CRC is no proof: anyone who reaches the store can write an object whose checksums all hold. A server
    with the key serves only objects whose HMAC holds, and counts the others as forged."""
    key_file = secret_file(tmp_path, "mac", os.urandom(32))
    other_key = secret_file(tmp_path, "mac2", os.urandom(32))
    good, evil = random.Random(2).randbytes(300_000), random.Random(3).randbytes(300_000)
    with adapter(store.url, mac_key_file=key_file) as ours, adapter(store.url) as stranger, \
            adapter(store.url, mac_key_file=other_key) as other:
        ours.put(KEY, 0, NS, good)
        with adapter(store.url, mac_key_file=key_file) as same_key:  # another server with the key
            assert read_back(same_key, KEY, len(good)) == good

        # 1. a stranger without the key writes an object of its own, with valid checksums
        k2 = bytes(range(1, 17))
        stranger.put(k2, 0, NS, evil)
        assert read_back(ours, k2, len(evil)) is None
        # 2. one with another key
        k3 = bytes(range(2, 18))
        other.put(k3, 0, NS, evil)
        assert read_back(ours, k3, len(evil)) is None
        # 3. our own object, its payload replaced and every checksum fixed to match
        client = store.client()
        mkey = f"hybridkv:m:{{{KEY.hex()}-0}}"
        meta = client.get(mkey)
        hdr = ObjectHeader.unpack(meta[:HEADER_BYTES])
        forged_hdr = ObjectHeader(hdr.ns, hdr.key, hdr.group, len(evil), zlib.crc32(evil)).pack()
        chunk = struct.unpack_from("<I", meta, HEADER_BYTES)[0]
        client.set(mkey, forged_hdr + meta[HEADER_BYTES:])
        for i in range(0, len(evil), chunk):
            client.set(f"hybridkv:d:{{{KEY.hex()}-0}}:{i // chunk}", evil[i:i + chunk])
        assert read_back(ours, KEY, len(evil)) is None
        assert ours.stats()["forged"] == 3
        assert read_back(stranger, KEY, len(evil)) is None  # removed: the stranger no longer finds it either


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificates")
def test_tls_with_a_client_certificate(tmp_path):
    """rediss:// to a store that speaks only TLS and asks for client certificates (tls-auth-clients)."""
    certs = rediskit.make_certs(str(tmp_path))
    store = rediskit.RedisProcess(certs=certs)
    try:
        data = random.Random(4).randbytes(300_000)
        tls = {"tls_ca_file": f"{certs}/ca.crt", "tls_cert_file": f"{certs}/client.crt",
               "tls_key_file": f"{certs}/client.key"}
        with adapter(store.url, **tls) as l2:
            l2.put(KEY, 0, NS, data)
            assert read_back(l2, KEY, len(data)) == data
            assert l2.stats()["store_up"] == 1
        with adapter(store.url, tls_ca_file=f"{certs}/ca.crt") as no_cert:  # the store refuses the handshake
            assert read_back(no_cert, KEY, len(data)) is None
            with pytest.raises(L2Error):
                no_cert.put(KEY, 1, NS, data)
        with adapter(store.url.replace("rediss://", "redis://")) as plain:  # no TLS at all
            assert read_back(plain, KEY, len(data)) is None
        with adapter(store.url, **{**tls, "tls_ca_file": f"{certs}/client.crt"}) as wrong_ca:  # unverified store
            assert read_back(wrong_ca, KEY, len(data)) is None
        # the certificate is for 127.0.0.1: the same server reached as "localhost" is not the host it names
        with adapter(store.url.replace("127.0.0.1", "localhost"), **tls) as other_name:
            assert read_back(other_name, KEY, len(data)) is None
    finally:
        store.close()
    with pytest.raises(L2ConfigError, match="needs a rediss://"):
        adapter("redis://127.0.0.1:1/0", tls_ca_file=f"{certs}/ca.crt")


def test_an_acl_user_limited_to_its_prefix(tmp_path):
    """An ACL user that may touch only `tenant-a:*`: its adapter works there, is refused elsewhere, and a
    wrong password is a store that is down."""
    store = rediskit.RedisProcess(extra=("--user", "hkv-a", "on", ">acl-pass-a", "~tenant-a:*", "+@all"))
    try:
        data = random.Random(5).randbytes(300_000)
        pw = secret_file(tmp_path, "pw", b"acl-pass-a")
        with adapter(store.url, username="hkv-a", password_file=pw, prefix="tenant-a:") as mine:
            mine.put(KEY, 0, NS, data)
            assert read_back(mine, KEY, len(data)) == data
        with adapter(store.url, username="hkv-a", password_file=pw, prefix="tenant-b:") as elsewhere, \
                pytest.raises(L2Error):
            elsewhere.put(KEY, 0, NS, data)
        bad = secret_file(tmp_path, "bad", b"wrong")
        with adapter(store.url, username="hkv-a", password_file=bad, prefix="tenant-a:") as wrong:
            assert read_back(wrong, KEY, len(data)) is None
            assert wrong.stats()["store_up"] == 0
    finally:
        store.close()
