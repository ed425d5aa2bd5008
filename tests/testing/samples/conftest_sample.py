"""A user's conftest.py beside the sample tests (copied there as conftest.py)."""

import pytest


@pytest.fixture
def shared_value():
    return 42
