"""Fixtures of the reliability suite: a ``figures`` recorder whose lines are
printed in pytest's terminal summary (trials run, kills survived, corruptions
caught, operations per second)."""

from __future__ import annotations

import pytest

_FIGURES: list[str] = []


@pytest.fixture
def figures(request):
    """Call with a format string and values to report a figure for this test."""
    def record(line: str) -> None:
        _FIGURES.append(f"{request.node.name}: {line}")
    return record


def pytest_terminal_summary(terminalreporter):
    if _FIGURES:
        terminalreporter.section("reliability figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)
