"""A location whose server cannot be reached, as the batch command meets it: said with the URL."""

from __future__ import annotations

import pytest

from shardline.local_ports import reserve_port
from shardline.storage.fs import open_fs
from shardline.storage.retry import is_transient


def test_a_location_whose_server_cannot_be_reached_is_named_with_what_to_do() -> None:
    # ftp (and sftp) connect when the file system is made: the bare "[Errno 111] Connection refused" named neither
    # the location nor what to do. Still a ConnectionError: transient, retried, a re-run's exit code.
    closed = reserve_port()  # reserved for this process, and nothing listens there
    with pytest.raises(ConnectionError, match=rf"the location ftp://127.0.0.1:{closed}/in cannot be reached "
                       r"\(ConnectionRefusedError: .*\): check its URL and that its server answers") as refused:
        open_fs(f"ftp://127.0.0.1:{closed}/in")
    assert is_transient(refused.value)
