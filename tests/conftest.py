"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from helpers import assert_no_leaked_processes


@pytest.fixture
def no_leaked_processes() -> Iterator[None]:
    """Fails the test if a device service or agent it started outlives it (opt in per module)."""
    yield
    assert_no_leaked_processes()
