"""Adapter files in Redis (the SharedBlobs of store.redis), so any gateway can serve any adapter.

Keys, under the store's prefix (RedisKeys), for the blob whose digest (store.blobs) is D:
    blob:D                  its manifest, JSON: {"files": [{"name", "size", "num_chunks"}, ...]}
    blob:D:N                chunk N (from 0) of its files: each file's chunks follow those of the
                            file before it in the manifest; at most `chunk_bytes` each
    blob-staged:T:N         chunk N of a write (token T) not committed yet; expires in an hour
A write stages every chunk, then one MULTI renames them to blob:D:N and writes the manifest, so a
reader that finds a manifest finds every chunk it names, and a reader that finds none treats the
blob as absent (whatever chunks there are). A write that fails (Redis out of memory, a lost
connection, the task cancelled) deletes the chunks it staged; those of a writer that crashed, or
that Redis could not take back, expire. Redis never gets one value of more than `chunk_bytes`.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from store.blobs import ADAPTER_FILES
from store.errors import StoreError

if TYPE_CHECKING:
    from store.redis import RedisKeys

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
_STAGED_TTL_MS = 3600 * 1000  # a write not committed in an hour has crashed
_FETCH_TRIES = 3  # reads of a blob that is deleted and written again as it is read
# Cleanups of failed writes under way: the event loop keeps only weak references to tasks, and a
# cleanup outlives the write it follows when that write is cancelled again (see _shielded).
_cleanups: set[asyncio.Task[None]] = set()


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
        staged = _StagedChunks(self._redis, self._keys)
        try:
            manifest = BlobManifest([await self._stage(folder / name, staged) for name in names])
            async with self._redis.pipeline(transaction=True) as pipe:
                for n in range(manifest.num_chunks):
                    pipe.rename(staged.key(n), self._keys.blob_chunk(digest, n))
                    pipe.persist(self._keys.blob_chunk(digest, n))
                pipe.set(self._keys.blob(digest), msgspec.json.encode(manifest))
                await pipe.execute()
        except BaseException:
            # NOTE: BaseException and shielded: a write cancelled (its client left, a shutdown's
            # deadline) must give its chunks back too. Left to expire, they would hold Redis's
            # memory for an hour: out of its maxmemory, Redis would refuse every write meanwhile.
            await _shielded(self._give_back(staged))
            raise

    async def _give_back(self, staged: _StagedChunks) -> None:
        """Free the memory Redis holds for a failed write: the chunks it staged, and the buffers of
        its connections (the one a refused chunk was read into stays counted against maxmemory
        until Redis trims it). Best effort: the chunks Redis cannot delete now expire."""
        try:
            await staged.discard()
            # NOTE: the idle connections only: the others carry calls under way.
            await self._redis.connection_pool.disconnect(inuse_connections=False)
        except (RedisError, OSError) as error:
            logger.warning("cannot give back to Redis what a failed write of adapter files took "
                           "there (at most %d chunks); the chunks expire within the hour: %s",
                           staged.num_tried, error)

    async def _stage(self, path: Path, staged: _StagedChunks) -> BlobFile:
        """Write the file at `path` as the next chunks of `staged`."""
        size = num_chunks = 0
        source = await asyncio.to_thread(open, path, "rb")
        try:
            while chunk := await asyncio.to_thread(source.read, self.chunk_bytes):
                await staged.add(chunk)
                size += len(chunk)
                num_chunks += 1
        finally:
            source.close()
        return BlobFile(path.name, size, num_chunks)

    async def fetch_into(self, digest: str, folder: Path,
                         names: Sequence[str] = ADAPTER_FILES) -> bool:
        for _ in range(_FETCH_TRIES):
            raw = await self._redis.get(self._keys.blob(digest))
            if raw is None:
                return False
            manifest = _decode(raw, digest)
            if sorted(f.name for f in manifest.files) != sorted(names):  # never a path of its own
                raise StoreError(f"the manifest of blob {digest} in Redis lists other files than "
                                 f"{', '.join(names)}")
            missing = await self._fetch_files(digest, manifest, folder)
            if missing is None:
                return True
            # NOTE: a chunk gone since the manifest was read is not damage when the blob was
            # deleted meanwhile (its adapter deleted through another gateway: one MULTI drops the
            # manifest and the chunks), and perhaps written anew since: read the manifest again.
            # Only a manifest that still names a chunk that is not there is a damaged copy.
            if await self._redis.exists(self._keys.blob_chunk(digest, missing)) == 0 \
                    and await self._redis.exists(self._keys.blob(digest)) == 1:
                raise StoreError(f"chunk {missing} of blob {digest} is missing from Redis")
        raise StoreError(f"blob {digest} was deleted and written again in Redis while it was "
                         f"read, {_FETCH_TRIES} times over")

    async def _fetch_files(self, digest: str, manifest: BlobManifest, folder: Path) -> int | None:
        """Write the files of the blob into `folder`; the number of the first chunk found
        missing, None if none was."""
        first = 0
        for file in manifest.files:
            chunks = range(first, first + file.num_chunks)
            missing = await self._fetch(digest, chunks, folder / file.name)
            if missing is not None:
                return missing
            first += file.num_chunks
        return None

    async def _fetch(self, digest: str, chunks: range, path: Path) -> int | None:
        """Write chunks `chunks` of the blob as the file at `path`; the number of the first chunk
        found missing, None if none was."""
        out = await asyncio.to_thread(open, path, "wb")
        try:
            for n in chunks:
                chunk = await self._redis.get(self._keys.blob_chunk(digest, n))
                if chunk is None:
                    return n
                await asyncio.to_thread(out.write, chunk)
            return None
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


class _StagedChunks:
    """The chunks one write stages, under a token of its own, before it commits them."""

    def __init__(self, client: aioredis.Redis, keys: RedisKeys) -> None:
        self._redis = client
        self._keys = keys
        self._token = secrets.token_hex(8)
        # Those written, and the one being written: a SET whose reply never came may have landed.
        self.num_tried = 0

    def key(self, index: int) -> str:
        return self._keys.blob_staged(self._token, index)

    async def add(self, chunk: bytes) -> None:
        """Stage `chunk` as the next one; it expires unless committed or discarded first."""
        self.num_tried += 1
        await self._redis.set(self.key(self.num_tried - 1), chunk, px=_STAGED_TTL_MS)

    async def discard(self) -> None:
        """Delete every chunk staged."""
        if self.num_tried > 0:
            # NOTE: alone, not in a transaction: out of its maxmemory, Redis still takes a DEL,
            # but no command queued in a MULTI.
            await self._redis.delete(*(self.key(n) for n in range(self.num_tried)))


async def _shielded(cleanup: Coroutine[None, None, None]) -> None:
    """Await `cleanup`, which runs to its end even if the caller is cancelled meanwhile."""
    task = asyncio.ensure_future(cleanup)
    _cleanups.add(task)
    task.add_done_callback(_cleanups.discard)
    await asyncio.shield(task)


def _decode(raw: bytes, digest: str) -> BlobManifest:
    try:
        return msgspec.json.decode(raw, type=BlobManifest)
    except msgspec.DecodeError as error:  # ValidationError is one
        raise StoreError(f"the manifest of blob {digest} in Redis is unreadable: {error}") from None
