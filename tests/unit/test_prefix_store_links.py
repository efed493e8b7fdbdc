"""The prompt store follows symbolic links only while they stay inside it: a link out of the
store (to a valid prefix), a link to a device, a FIFO (linked or not), a directory and a broken
link are refused with the message of an unknown id, without blocking; links within the store,
and a store whose own path is a link, work."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from server.messages import ValidationError
from tests.unit.test_prompt_prefix import make_store, random_prefix, write_peft_folder


def _not_found(prefix_id: str) -> str:
    return f"can't retrieve prompt prefix with id '{prefix_id}': " + (
        f'prefix id "{prefix_id}" not found'
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A store beside a folder of valid prefixes outside it."""
    outside, store = tmp_path / "outside", tmp_path / "store"
    outside.mkdir()
    store.mkdir()
    torch.save(random_prefix(3, 1), outside / "secret.pt")
    write_peft_folder(outside / "peft", random_prefix(4, 2))
    torch.save(random_prefix(5, 3), store / "real.pt")
    return store


def _make(kind: str, root: Path) -> None:
    """Put `kind` of thing at the store's id "link"."""
    secret = root.parent / "outside" / "secret.pt"
    link = root / "link.pt"
    if kind == "link-out":
        link.symlink_to(secret)
    elif kind == "relative-link-out":
        link.symlink_to(os.path.relpath(secret, root))
    elif kind == "folder-link-out":  # a PEFT folder outside
        (root / "link").symlink_to(root.parent / "outside" / "peft")
    elif kind == "device":
        link.symlink_to("/dev/zero")
    elif kind == "fifo":
        os.mkfifo(link)
    elif kind == "link-to-fifo":
        os.mkfifo(root / "pipe")
        link.symlink_to(root / "pipe")
    elif kind == "directory":
        link.mkdir()
    elif kind == "broken-link":
        link.symlink_to(root / "gone.pt")


@pytest.mark.parametrize(
    "kind",
    ["link-out", "relative-link-out", "folder-link-out", "device", "fifo", "link-to-fifo",
     "directory", "broken-link"],
)  # fmt: skip
def test_refused_like_an_unknown_id(root: Path, kind: str) -> None:
    _make(kind, root)
    failures: list[int] = []
    store = make_store(root, on_failure=lambda: failures.append(1))
    with pytest.raises(ValidationError) as e:
        store.get("link")
    assert e.value.message == _not_found("link")
    assert failures == [1]
    assert store.get("real").num_tokens == 5  # the store still serves its own files


def test_links_within_the_store_are_followed(root: Path) -> None:
    (root / "team").mkdir()
    (root / "team" / "alias.pt").symlink_to(root / "real.pt")
    (root / "current").symlink_to("team")  # a relative link to a folder of the store
    store = make_store(root)
    expected = torch.load(root / "real.pt")
    assert torch.equal(store.get("team/alias").embeds, expected)
    assert torch.equal(store.get("current/alias").embeds, expected)


def test_a_linked_store_path_works(root: Path) -> None:
    link = root.parent / "store-link"
    link.symlink_to(root)
    (root / "peft").symlink_to(root.parent / "outside" / "peft")
    store = make_store(link)
    assert store.get("real").num_tokens == 5
    with pytest.raises(ValidationError, match='prefix id "peft" not found'):
        store.get("peft")
