"""Reading server-sent events back: lines split at CR/LF bytes only, whatever the text holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec

from gateway.sse import sse_lines


async def _pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


def _lines(data: bytes, size: int) -> list[str]:
    async def read() -> list[str]:
        return [line async for line in sse_lines(_pieces(data, size))]
    return asyncio.run(read())


def test_events_survive_characters_that_other_line_readers_split_at():
    texts = ["a\u2028b", "c\x85d\u2029", "e\x1cf\x1d\x1e", "naïve\r\nline", "\u0800"]
    stream = b"".join(b"data: " + msgspec.json.encode({"text": t}) + b"\n\n" for t in texts)
    stream += b"data: [DONE]\r\n\r\n"
    for size in (1, 2, 3, 7, len(stream)):  # chunk boundaries anywhere, even inside a character
        data = [line[6:] for line in _lines(stream, size) if line.startswith("data: ")]
        assert [msgspec.json.decode(d)["text"] for d in data[:-1]] == texts
        assert data[-1] == "[DONE]"


def test_a_last_line_without_its_break_is_still_read():
    assert _lines(b"data: 1\r\ndata: 2", 3) == ["data: 1", "data: 2"]


def test_a_crlf_cut_between_its_cr_and_its_lf_is_one_line_break():
    """An LF that comes first in a piece after a CR ended the last one is that CR's: it was read
    as a line break of its own, an empty line (which ends an event) that the stream never held."""
    for size in (1, 2, 3):
        assert _lines(b"a\r\nbc\r\n\r\nd", size) == ["a", "bc", "", "d"]
    assert _lines(b"a\r\rb\n\rc", 2) == ["a", "", "b", "", "c"]  # lone CRs, and LF then CR
