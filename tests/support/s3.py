"""Objects put into and listed from the S3 server (moto's server mode) the S3 tests run against."""

from __future__ import annotations

from pathlib import Path

from tests.integration.conftest import S3Server


def upload(s3_server: S3Server, local: Path, url: str) -> None:
    """Copy every file of a local folder under an s3:// URL."""
    fs = s3_server.filesystem()
    for path in sorted(local.iterdir()):
        fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.name}")


def keys_under(s3_server: S3Server, url: str) -> list[str]:
    """Object names under an s3:// URL, relative to it, listed fresh from the server."""
    root = url.removeprefix("s3://")
    return sorted(p[len(root) + 1:] for p in s3_server.filesystem().find(root))
