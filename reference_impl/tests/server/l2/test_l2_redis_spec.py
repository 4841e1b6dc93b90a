"""Redis / Valkey L2 urls a hostile or careless operator gives `hybridkv serve`: each is a one-line error that
never shows a password written into the url (issue 23, round 4)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hybridkv.server.l2.redis_spec import RedisL2Spec
from hybridkv.server.l2.specs import L2ConfigError

SECRET = "hunter2"
BAD_URLS = [
    f"redis://:{SECRET}@localhost/abc",          # path not a database number: was shown with the password
    f"redis://:{SECRET}@/0",                     # no host
    f"redis://:{SECRET}@localhost:notaport/0",   # port does not parse
    f"redis://:{SECRET}@localhost:99999/0",      # port out of range
    f"http://:{SECRET}@localhost:6379/0",        # not a redis scheme
    f"redis://:pa#{SECRET}@localhost:6379/0",    # '#' in the password: urlsplit cuts the url there
    f"redis://u:pa/{SECRET}@localhost:6379/0",   # '/' in the password
    f"redis+cluster://u:pa/{SECRET}@h1:7000,h2:7001",
    f"redis+cluster://:{SECRET}@h1:7000,h2:x",
    f"redis+cluster://h1:7000,:{SECRET}@h2:bad",
    f"rediss+cluster://:{SECRET}@[::1:7000",
    f"valkey+cluster://:{SECRET}@h1:7000/3",
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_a_bad_url_with_a_password_is_refused_without_showing_it(url):
    with pytest.raises(L2ConfigError) as e:
        RedisL2Spec(url=url)
    shown = str(e.value)
    assert SECRET not in shown and "'pa'" not in shown and "u:pa" not in shown and "\n" not in shown, shown


@pytest.mark.parametrize("url", [BAD_URLS[0], BAD_URLS[7], "redis+cluster://h:1/2", "redis+cluster://,,"])
def test_serve_with_a_bad_url_is_one_line_without_the_password(sock_dir, url):
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--endpoint", f"ipc://{sock_dir}/x.sock",
                        "--l1-gib", "0.01", "--l2-adapter", f'{{"type":"redis","url":"{url}"}}'],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and SECRET not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("prefix", ["{t}", "a{", "}", "a b", ""])
def test_a_prefix_with_a_hash_tag_brace_is_refused(prefix):
    with pytest.raises(L2ConfigError, match="prefix"):
        RedisL2Spec(url="redis+cluster://h1:7000", prefix=prefix)
