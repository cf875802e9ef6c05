"""Shared pytest options: ``--soak`` runs the long reliability variants
(tests marked ``soak``); without it they are skipped. Shared fixtures:
``store`` (RAM only) and ``ssd`` (a factory of stores on one path), both of
``_helpers.BS``-token blocks; a module's own fixture of the same name wins.
Model-file digests are remembered in the session's own folder
(``$KVSTORE_CACHE_DIR``, inherited by server processes), not the user's."""

from __future__ import annotations

import pytest

from kvstore.store import PrefixStore

from ._helpers import BS


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long reliability soak tests (marked `soak`)")


@pytest.fixture(scope="session", autouse=True)
def _digest_memory(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVSTORE_CACHE_DIR", str(tmp_path_factory.mktemp("kvstore-cache")))
    yield
    mp.undo()


def pytest_collection_modifyitems(config, items):
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def store():
    s = PrefixStore(budget_gb=1, block_size=BS)
    yield s
    s.close()


@pytest.fixture
def ssd(tmp_path):
    opened = []

    def open_(**kw):
        kw = dict(dict(budget_gb=1, block_size=BS, ssd_path=tmp_path / "store", disk_budget_gb=1), **kw)
        s = PrefixStore(**kw)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server of the test's own on a free port, killed after it (skips where none is installed)."""
    from ._redis import RedisServer, need_redis

    need_redis()
    s = RedisServer(tmp_path / "redis").start()
    yield s
    s.kill()
