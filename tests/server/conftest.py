"""The tier of tests that start the real server (`tools.server_process.ServerProcess`): every test
under this folder is marked `server`, so `pytest -m "not server"` (`make test-fast`) leaves them
out. Tests that need no server process belong in tests/unit/."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.server)
