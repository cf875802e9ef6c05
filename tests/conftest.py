"""Shared pytest options: ``--soak`` runs the long reliability variants
(tests marked ``soak``); without it they are skipped."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the long reliability soak tests (marked `soak`)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--soak"):
        return
    skip = pytest.mark.skip(reason="soak test: run with --soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)
