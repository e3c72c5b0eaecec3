"""Adapter files in Redis (the SharedBlobs of store.redis), so any gateway can serve any adapter.

Keys, under the store's prefix (RedisKeys), for the blob whose digest (store.blobs) is D:
    blob:D                  its manifest, JSON: {"files": [{"name", "size", "num_chunks"}, ...]}
    blob:D:N                chunk N (from 0) of its files: each file's chunks follow those of the
                            file before it in the manifest; at most `chunk_bytes` each
    blob-staged:T:N         chunk N of a write (token T) not committed yet; expires in an hour
A write stages every chunk, then one MULTI renames them to blob:D:N and writes the manifest, so a
reader that finds a manifest finds every chunk it names, and a reader that finds none treats the
blob as absent (whatever chunks there are). The chunks of a write that never commits expire.
Redis never gets one value of more than `chunk_bytes`.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

from store.blobs import ADAPTER_FILES
from store.errors import StoreError

if TYPE_CHECKING:
    from store.redis import RedisKeys

CHUNK_BYTES = 4 << 20
_STAGED_TTL_MS = 3600 * 1000  # a write not committed in an hour has crashed


class BlobFile(msgspec.Struct, frozen=True):
    name: str
    size: int
    num_chunks: int


class BlobManifest(msgspec.Struct, frozen=True):
    files: list[BlobFile]

    @property
    def num_chunks(self) -> int:
        return sum(f.num_chunks for f in self.files)


class RedisBlobs:
    """SharedBlobs over Redis; `client` must not decode responses (chunks are bytes)."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self._redis = client
        self._keys = keys
        self.chunk_bytes = chunk_bytes

    async def close(self) -> None:
        await self._redis.aclose()

    async def put_files(self, digest: str, folder: Path,
                        names: Sequence[str] = ADAPTER_FILES) -> None:
        if await self._redis.exists(self._keys.blob(digest)):
            return  # NOTE: content-addressed: what is kept under the digest is these very files
        token, files, num_chunks = secrets.token_hex(8), [], 0
        for name in names:
            files.append(await self._stage(folder / name, token, num_chunks))
            num_chunks += files[-1].num_chunks
        manifest = BlobManifest(files)
        async with self._redis.pipeline(transaction=True) as pipe:
            for n in range(manifest.num_chunks):
                pipe.rename(self._keys.blob_staged(token, n), self._keys.blob_chunk(digest, n))
                pipe.persist(self._keys.blob_chunk(digest, n))
            pipe.set(self._keys.blob(digest), msgspec.json.encode(manifest))
            await pipe.execute()

    async def _stage(self, path: Path, token: str, first: int) -> BlobFile:
        """Write the file at `path` as staged chunks `first`, `first` + 1, ..."""
        size = num_chunks = 0
        source = await asyncio.to_thread(open, path, "rb")
        try:
            while chunk := await asyncio.to_thread(source.read, self.chunk_bytes):
                await self._redis.set(self._keys.blob_staged(token, first + num_chunks), chunk,
                                      px=_STAGED_TTL_MS)
                size += len(chunk)
                num_chunks += 1
        finally:
            source.close()
        return BlobFile(path.name, size, num_chunks)

    async def fetch_into(self, digest: str, folder: Path,
                         names: Sequence[str] = ADAPTER_FILES) -> bool:
        raw = await self._redis.get(self._keys.blob(digest))
        if raw is None:
            return False
        manifest = _decode(raw, digest)
        if sorted(f.name for f in manifest.files) != sorted(names):  # never a path of its own
            raise StoreError(f"the manifest of blob {digest} in Redis lists other files than "
                             f"{', '.join(names)}")
        first = 0
        for file in manifest.files:
            await self._fetch(digest, range(first, first + file.num_chunks), folder / file.name)
            first += file.num_chunks
        return True

    async def _fetch(self, digest: str, chunks: range, path: Path) -> None:
        """Write chunks `chunks` of the blob as the file at `path`."""
        out = await asyncio.to_thread(open, path, "wb")
        try:
            for n in chunks:
                chunk = await self._redis.get(self._keys.blob_chunk(digest, n))
                if chunk is None:
                    raise StoreError(f"chunk {n} of blob {digest} is missing from Redis")
                await asyncio.to_thread(out.write, chunk)
        finally:
            await asyncio.to_thread(out.close)

    async def delete_unreferenced(self, digest: str) -> bool:
        return await self._delete(digest, self._keys.digest(digest))

    async def drop(self, digest: str) -> None:
        await self._delete(digest, None)

    async def _delete(self, digest: str, refs: str | None) -> bool:
        """Delete the blob, unless the key `refs` (if any) exists."""
        manifest_key = self._keys.blob(digest)

        async def delete(pipe: Pipeline) -> bool:
            raw = await pipe.get(manifest_key)
            if raw is None or (refs is not None and await pipe.exists(refs)):
                return False
            try:
                chunks = range(_decode(raw, digest).num_chunks)
            except StoreError:  # the next write of these files reuses the chunks' keys
                chunks = range(0)
            pipe.multi()
            pipe.delete(manifest_key, *(self._keys.blob_chunk(digest, n) for n in chunks))
            return True

        # NOTE: watching the references: a record written meanwhile retries this, and keeps it.
        watches = (manifest_key,) if refs is None else (manifest_key, refs)
        return await self._redis.transaction(delete, *watches, value_from_callable=True)


def _decode(raw: bytes, digest: str) -> BlobManifest:
    try:
        return msgspec.json.decode(raw, type=BlobManifest)
    except msgspec.DecodeError as error:  # ValidationError is one
        raise StoreError(f"the manifest of blob {digest} in Redis is unreadable: {error}") from None
