"""The remote tier over TLS (``rediss://``), against a real redis-server
listening on TLS only (Debian's build has TLS), under a self-signed
certificate the tests make with ``openssl``: hosts share blocks bit-exact, an
untrusted certificate or a TLS option on a plain URL is an error at open."""

import json
import shutil

import pytest

from kvstore import PrefixStore
from kvstore.errors import RemoteConfigError
from kvstore.tiers.remote.tier import PREFIX
from kvstore.tiers.remote.url import RemoteURL

from ._helpers import assert_hit_is
from ._redis import PASSWORD, RedisServer, need_redis
from .test_remote import MODEL, host, kvstore, prompt, put  # noqa: F401 (fixtures)


@pytest.fixture
def tls_server(tmp_path):
    need_redis()
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: the test certificate cannot be made")
    s = RedisServer(tmp_path / "redis-tls", tls=True).start()
    yield s
    s.kill()


def test_hosts_share_blocks_bit_exact_over_tls_with_signed_blocks(tls_server, host):
    url = tls_server.url
    assert url.startswith("rediss://") and "ssl_ca_certs=" in url
    tokens = prompt(300, seed=21)
    put(host("a", url, remote_secret="s"), tokens)
    b = host("b", url, remote_secret="s")
    hit = b.fetch(MODEL, tokens)
    assert_hit_is(hit, tokens, 300)
    st = b.stats()
    assert hit.remote_tokens == 300 and st["remote_blocks_read"] == 5 and st["remote_errors"] == 0
    assert len(tls_server.client().keys(PREFIX + b"-:{*}")) == 5  # 4 full blocks and the tail
    # the maintenance commands take the same URL
    res = kvstore("stats", "--remote", url, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["blocks"] == 5, res.stderr


def test_an_untrusted_certificate_is_an_error_at_open_naming_the_url_without_its_password(tls_server, tmp_path):
    untrusted = f"rediss://:{PASSWORD}@127.0.0.1:{tls_server.port}/0"  # the system's CAs did not sign it
    with pytest.raises(RemoteConfigError, match="TLS certificate is not trusted") as e:
        PrefixStore(ssd_path=tmp_path / "s", remote=untrusted)
    assert PASSWORD not in str(e.value) and f"127.0.0.1:{tls_server.port}" in str(e.value)


@pytest.mark.parametrize("url, why", [
    ("redis://h:6379/0?ssl_ca_certs=/etc/hostname", "applies to TLS only"),
    ("rediss://h:6379/0?ssl_ca_certs=/no/such/ca.pem", "no such file"),
    ("rediss://h:6379/0?ssl_ciphers=x", "unknown parameter"),
])
def test_tls_options_are_checked_at_parse(url, why):
    with pytest.raises(RemoteConfigError, match=why):
        RemoteURL.parse(url)
