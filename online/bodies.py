"""Request bodies as the online tier and the router take them: their size and their Content-Encoding.

Framework-free (the router reads bodies with it too): a declared size, and a body decompressed
within a limit, with the messages a client is told.
"""

from __future__ import annotations

import re
import zlib
from typing import Any, Awaitable, Callable

from shardline.errors import InvalidInput, PayloadTooLarge, UnsupportedEncoding
from shardline.online.errors import shown

MAX_GZIP_MEMBERS = 64  # concatenated gzip streams in one body (gzip(1) reads them all; so does this)
_BYTE_COUNT = re.compile(r"[0-9]{1,15}")  # ASCII digits (str.isdigit takes '²', int() does not), a sane length


def byte_count(header: str | None) -> int | None:
    """A header that counts bytes (Content-Length, Inference-Header-Content-Length) as a number; None
    when it is absent or not 1-15 ASCII digits."""
    if header is None:
        return None
    text = header.strip()
    return int(text) if _BYTE_COUNT.fullmatch(text) else None


class ClientGone(Exception):
    """The client went away while its request was read: nobody is left to answer."""


# The status the access log and the request metrics give a request whose client went away before it was answered
# (its body cut off, or too slow: the connection's own 408 is written below the app): nginx's 499, "client closed
# request". Not the server's fault, so not a 5xx in the error ratio an SLO alerts on; not the client's 400 either; not
# in the latency histogram (no answer was timed) nor metered.
CLIENT_GONE = 499


async def receive_body(receive: Callable[[], Awaitable[dict[str, Any]]], content_length: str | None, limit: int) -> bytes:
    """The request's body from an ASGI ``receive``, as sent (not decompressed), at most ``limit`` bytes.

    Raises:
        PayloadTooLarge: the body, as declared (``content_length``) or as sent, is over the limit.
        ClientGone: the client disconnected before the body was read.
    """
    declared = byte_count(content_length)
    if declared is not None and declared > limit:
        raise PayloadTooLarge(too_large(f"{content_length} bytes", limit), limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone("the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise PayloadTooLarge(too_large(f"at least {size} bytes", limit), limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def decode_body(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    """A body as sent with ``Content-Encoding`` (none, identity, gzip or deflate), decompressed within ``limit``.

    Raises:
        PayloadTooLarge, UnsupportedEncoding, InvalidInput: as ``read_body``.
    """
    encoding = (content_encoding or "").strip().lower()
    if encoding in ("", "identity"):
        return body
    if encoding in ("gzip", "x-gzip"):
        return _inflate(body, 16 + zlib.MAX_WBITS, limit, "gzip", MAX_GZIP_MEMBERS)
    if encoding == "deflate":
        return _inflate(body, zlib.MAX_WBITS, limit, "deflate", 1)  # (raw deflate too, as some clients send)
    raise UnsupportedEncoding(
        f"Content-Encoding {shown(encoding)} is not supported; send the body uncompressed, gzip or deflate"
    )


def too_large(size: str, limit: int) -> str:
    return (
        f"the request body is {size}, over the limit of {limit} bytes; send fewer rows per request "
        "(or raise SHARDLINE_ONLINE_MAX_BODY_BYTES on the server)"
    )


def _inflate(body: bytes, wbits: int, limit: int, name: str, members: int) -> bytes:
    """Every member of a compressed body (gzip: concatenated streams, as gzip(1) reads them; trailing
    zero bytes are padding), within ``limit`` bytes in all."""
    parts: list[bytes] = []
    size, rest = 0, body
    for _ in range(members):
        inflater = zlib.decompressobj(wbits)
        try:
            part = inflater.decompress(rest, limit - size + 1)
        except zlib.error as e:
            if wbits == zlib.MAX_WBITS and not parts:  # deflate without the zlib wrapper, as some clients send
                return _inflate(body, -zlib.MAX_WBITS, limit, name, members)
            raise InvalidInput(
                f"the request body is not valid {name} data ({e}){' after its first member' if parts else ''}; "
                "compress it again or send it plain"
            ) from e
        size += len(part)
        if size > limit or inflater.unconsumed_tail:
            raise PayloadTooLarge(
                f"the {name} request body inflates to more than the limit of {limit} bytes; send fewer rows per "
                "request (or raise SHARDLINE_ONLINE_MAX_BODY_BYTES on the server)", limit,
            )
        if not inflater.eof:
            raise InvalidInput(f"the {name} request body is cut short; send the whole compressed body")
        parts.append(part)
        rest = inflater.unused_data
        if not rest.strip(b"\0"):
            return parts[0] if len(parts) == 1 else b"".join(parts)
    raise InvalidInput(
        f"the {name} request body goes on after {members} compressed "
        f"{'stream' if members == 1 else 'members'}; send {'one stream' if members == 1 else 'fewer members'} "
        "(or the body uncompressed)"
    )
