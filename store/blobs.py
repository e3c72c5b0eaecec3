"""Content-addressed folder of adapter files: <root>/<digest>/<file name>.

The digest is an adapter's identity (DESIGN.md, "Adapter identity"): the sha256 over its files
taken in sorted name order, each fed as
    name (UTF-8) + b"\\0" + size (8 bytes, big-endian) + contents.
The size makes the boundaries unambiguous. The same files give the same digest and share one
folder, whoever uploads them; changed files give a new digest, so caches never serve old weights.

Where the store keeps adapter files too (Store.shared_blobs: Redis), the folder is a cache in
front of them: fetch_blob copies a blob the folder lacks from the store, checking its digest, and
ensure_intact_copy fetches again one whose files were damaged on disk since.
"""

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from store.base import SHARED_STORE_ID_PREFIX, SharedBlobs, Store
from store.errors import StoreError
from store.models import is_digest, validate_digest, validate_name

logger = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# How often a process whose folder caches the store's shared copies (a gateway or a worker on
# Redis) drops the files of adapters deleted through the others: no record names them, so no
# request can, and without this they would fill its disk until it restarts.
SWEEP_PERIOD_S = 600.0
# Where a folder caches adapters whose records it cannot read (a worker whose gateways keep them
# in a store of their own), it drops the files no request used for this long instead: those of
# deleted adapters go too, as no request names them.
UNUSED_BLOB_S = 24 * 3600.0
# The file in an adapter folder naming the store whose files it keeps (BlobStore.claim).
OWNER_FILE = ".switchboard-store-id"
_CHUNK_BYTES = 1 << 20
_STALE_TMP_S = 3600.0  # a put that has not finished in an hour has crashed


def digest_files(folder: Path, names: Sequence[str] = ADAPTER_FILES) -> str:
    """The digest (see the module docstring) of the named files in `folder`."""
    h = hashlib.sha256()
    for name in sorted(names):
        path = folder / name
        h.update(name.encode() + b"\0" + path.stat().st_size.to_bytes(8, "big"))
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


@dataclass
class _DigestLock:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0  # holding it or waiting for it


class DigestLocks:
    """One asyncio lock per blob digest, made on first use and dropped once no one holds or
    awaits it. A blob's presence is decided in steps that must not interleave with another
    task's: a delete's "unreferenced?" and its delete; an upload's "stored?" and its record; a
    fetch's "missing?" (or "damaged?") and its fetch. Each holds the digest's lock across its
    steps."""

    def __init__(self) -> None:
        self._locks: dict[str, _DigestLock] = {}

    @contextlib.asynccontextmanager
    async def hold(self, digest: str) -> AsyncIterator[None]:
        entry = self._locks.setdefault(digest, _DigestLock())
        entry.num_users += 1
        try:
            async with entry.lock:
                yield
        finally:
            # NOTE: counted, not lock.locked(): a released lock reads unlocked before the waiter it
            # wakes takes it, and a fresh lock made then would let a third task in beside it.
            entry.num_users -= 1
            if entry.num_users == 0:
                del self._locks[digest]


class BlobStore:
    """Adapter file sets by digest. Blocking file IO: call from a thread in async code.

    `locks` (asyncio) order the tasks of one process that store, fetch or delete a blob; see
    collect_garbage."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.locks = DigestLocks()
        self.warned_of_owner = False  # that the folder keeps another store's files
        root.mkdir(parents=True, exist_ok=True)

    def claim(self, store_id: str) -> str:
        """The id of the store whose adapter files this folder keeps: `store_id`, written here
        (OWNER_FILE) where the folder names none yet, or a store that keeps shared copies of its
        files (a Redis one: this folder only cached them). NOTE: a folder is the only copy of a
        SQLite store's files: a gateway started on another store (a fresh one: a --data-dir
        mistyped, or relative to another working folder) must not take them for deleted ones."""
        marker = self.root / OWNER_FILE
        try:
            owner = marker.read_text().strip()
        except FileNotFoundError:
            owner = None
        if owner is not None and (owner == store_id or not owner.startswith(SHARED_STORE_ID_PREFIX)):
            return owner
        tmp = self.root / f".tmp-{secrets.token_hex(8)}"
        tmp.write_text(store_id)
        _fsync(tmp)
        try:
            if owner is None:
                os.link(tmp, marker)  # NOTE: made whole or not at all, and never over another's
            else:
                os.replace(tmp, marker)
        except FileExistsError:
            return marker.read_text().strip()
        finally:
            tmp.unlink(missing_ok=True)
        return store_id

    def put(self, src: Path, names: Sequence[str] = ADAPTER_FILES, *, link: bool = False,
            expected: str | None = None) -> tuple[str, int]:
        """Store copies of the named files of folder `src`; returns (digest, total bytes).

        Atomic: the files are written and synced in a temporary folder that is then renamed to
        its digest, so a reader sees all of a blob or none of it. A stored copy of the same
        digest is hashed again, and replaced where its files were damaged since. `link`:
        hard-link the files instead of copying them where `src` is on the same file system (an
        upload staged under `root` is then stored without being written twice); the caller must
        never change them in place afterwards. Elsewhere, or where links fail, they are copied.
        `expected`: the digest the files must have; StoreError if they have another, and nothing
        is stored.
        """
        for name in names:
            validate_name("adapter file", name)
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise StoreError(
                f"{src} lacks {', '.join(missing)}: an adapter folder needs {', '.join(names)}"
            )
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))
        try:
            for name in names:
                _place(src / name, tmp / name, link)
                _fsync(tmp / name)
            digest = digest_files(tmp, names)
            if expected is not None and digest != expected:
                raise StoreError(f"the files hash to {digest}, not to {expected}: they were "
                                 "changed or damaged")
            size = sum((tmp / n).stat().st_size for n in names)
            self._install(tmp, digest, names)
            return digest, size
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _install(self, tmp: Path, digest: str, names: Sequence[str]) -> None:
        """Rename the finished folder `tmp` to `digest`, replacing a damaged stored copy."""
        target = self.root / digest
        if _rename_unless_present(tmp, target) or _holds(target, digest, names):
            return
        # The stored copy changed on disk since it was put (bit rot, a truncated or removed file):
        # the new files repair it, so that uploading them again, as an error tells users to, works.
        # NOTE: moved aside whole, then replaced whole: a reader sees the old or new copy, or none.
        logger.warning("replacing the damaged stored copy of adapter %s in %s", digest, self.root)
        self.delete(digest)
        _rename_unless_present(tmp, target)

    def path(self, digest: str) -> Path | None:
        """The folder holding the blob's files, or None if it is not stored."""
        folder = self.root / validate_digest(digest)
        return folder if folder.is_dir() else None

    def mark_used(self, digest: str) -> Path | None:
        """path(digest), the blob's use recorded now as its folder's modification time (which
        drop_unused_adapters reads)."""
        folder = self.path(digest)
        if folder is None:
            return None
        try:
            os.utime(folder)
        except FileNotFoundError:  # a put replacing a damaged copy moved it aside meanwhile
            return None
        return folder

    def delete_if_unused_since(self, digest: str, since: float) -> bool:
        """Remove a blob neither stored nor marked used since `since`; whether it was removed."""
        try:
            used_at = (self.root / validate_digest(digest)).stat().st_mtime
        except FileNotFoundError:
            return False
        return used_at < since and self.delete(digest)

    def delete(self, digest: str) -> bool:
        """Remove a blob; False if it was not stored. Readers never see a half-deleted blob."""
        trash = self.root / f".trash-{secrets.token_hex(8)}"
        try:
            os.rename(self.root / validate_digest(digest), trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash)
        return True

    def delete_if_damaged(self, digest: str) -> bool:
        """Remove a blob whose files no longer hash to its digest (changed on disk since it was
        put); whether it was removed. Hashes every file: for after a failure, not every read."""
        folder = self.path(digest)
        if folder is None or _holds(folder, digest, ADAPTER_FILES):
            return False
        logger.warning("removing the damaged stored copy of adapter %s from %s", digest, self.root)
        return self.delete(digest)

    def digests(self) -> list[str]:
        """The digests of every stored blob, sorted. Entries not named as blobs are not ours and
        are left as they are: a volume's `lost+found`, or a data folder's files where the blob
        folder is the data folder itself."""
        return sorted(p.name for p in self.root.iterdir() if is_digest(p.name))

    def remove_stale_temp(self, now: float) -> None:
        """Remove leftovers of puts and deletes that crashed (older than an hour)."""
        for p in self.root.iterdir():
            if not p.name.startswith((".tmp-", ".trash-")):
                continue
            try:
                modified = p.stat().st_mtime
            except FileNotFoundError:  # another task's put or delete finished since the listing
                continue
            if now - modified > _STALE_TMP_S:
                shutil.rmtree(p, ignore_errors=True)


async def fetch_blob(blobs: BlobStore, shared: SharedBlobs, digest: str) -> Path | None:
    """Copy the store's shared copy of blob `digest` into `blobs`; its local folder, or None if
    the store keeps none. StoreError if the copy is damaged (incomplete, or its files do not hash
    to `digest`): nothing of it is kept then, and it is dropped from the store, so that the next
    upload of the same files keeps them anew."""
    staging = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix=".tmp-fetch-", dir=blobs.root))
    try:
        if not await shared.fetch_into(digest, staging):
            return None
        # NOTE: put hashes the files again: a copy changed in the store never reaches the folder.
        await asyncio.to_thread(blobs.put, staging, link=True, expected=digest)
        return blobs.path(digest)
    except StoreError:
        await shared.drop(digest)
        raise
    finally:
        await asyncio.to_thread(shutil.rmtree, staging, True)


def is_out_of_space(error: BaseException) -> bool:
    """Whether `error` is a write its volume had no room left for (of bytes or of inodes): full,
    or the disk quota used up."""
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


async def ensure_intact_copy(blobs: BlobStore, shared: SharedBlobs | None, digest: str) -> bool:
    """Whether `blobs` holds an intact copy of blob `digest` now, once a copy damaged on disk
    since it was put is replaced by the store's shared copy, fetched again (see fetch_blob).
    Hashes the files: for after a reader found fault with them, not for every read. Without a
    good shared copy (none, or a damaged one, which fetch_blob drops from the store) a damaged
    copy stays, for an upload of the same files to replace."""
    # NOTE: held from the hash to the fetch, so that of the requests that found the files wrong at
    # once, one fetches them and the others find them intact.
    async with blobs.locks.hold(digest):
        folder = blobs.path(digest)
        if folder is None:
            return False
        if await asyncio.to_thread(_holds, folder, digest, ADAPTER_FILES):
            return True
        reason = "the store keeps no copy of adapter files"
        if shared is not None:
            try:
                if await fetch_blob(blobs, shared, digest) is not None:
                    return True
                reason = "the store holds none"
            except StoreError as error:
                reason = f"the store's is damaged too ({error})"
            except OSError as error:
                if not is_out_of_space(error):
                    raise
                reason = f"the folder has no room left to fetch the store's ({error})"
        logger.warning("kept the damaged copy of adapter %s in %s: %s", digest, blobs.root, reason)
        return False


async def collect_garbage(
    blobs: BlobStore, store: Store, digests: Sequence[str] | None = None
) -> list[str]:
    """Delete the blobs (all local ones, or just `digests`) that no adapter record references,
    from the folder and from the store's shared copies; returns those deleted from the folder.
    Where the folder keeps another store's files (BlobStore.claim), none is deleted from it: an
    adapter this store deletes may have the files of one that store keeps, and a SQLite store's
    folder holds their only copy.

    NOTE: each blob's `blobs.locks` lock is held from the check of its references to its delete,
    so an upload of the same files, which holds it from making sure the blob is stored to writing
    its record (gateway.adapter_api), comes wholly before (and is seen referencing it) or wholly
    after (and stores the blob again). Never call this while holding one of those locks.
    """
    keeps_own_files = await _keeps_own_files(blobs, store)
    if digests is None and not keeps_own_files:
        return []
    if keeps_own_files:
        await asyncio.to_thread(blobs.remove_stale_temp, time.time())
    removed = []
    for digest in blobs.digests() if digests is None else digests:
        async with blobs.locks.hold(digest):
            if await store.is_digest_referenced(digest):
                continue
            if store.shared_blobs is not None:
                await store.shared_blobs.delete_unreferenced(digest)
            if keeps_own_files and await asyncio.to_thread(blobs.delete, digest):
                removed.append(digest)
    return removed


async def _keeps_own_files(blobs: BlobStore, store: Store) -> bool:
    """Whether the folder keeps `store`'s files (BlobStore.claim); where not, say so once."""
    store_id = await store.get_store_id()
    owner = await asyncio.to_thread(blobs.claim, store_id)
    if owner != store_id and not blobs.warned_of_owner:
        blobs.warned_of_owner = True
        logger.warning(
            "the adapter folder %s keeps the files of another store (its %s names %s; this "
            "store is %s): files no adapter here names are left there, not deleted. If this "
            "gateway should run on that store, check --data-dir and --store (or --redis); if "
            "those files are no longer needed, delete them and %s", blobs.root, OWNER_FILE,
            owner, store_id, OWNER_FILE)
    return owner == store_id


async def drop_deleted_adapters(blobs: BlobStore, store: Store) -> None:
    """collect_garbage over the whole folder, saying what it removed."""
    removed = await collect_garbage(blobs, store)
    if removed:
        logger.info("removed the files of %d deleted adapters from %s", len(removed), blobs.root)


async def drop_unused_adapters(blobs: BlobStore, max_idle_s: float) -> None:
    """Delete the blobs not stored nor marked used (BlobStore.mark_used) for `max_idle_s`, and
    leftovers of crashed puts, saying what it removed.

    NOTE: each blob's `blobs.locks` lock is held from reading its last use to its delete, so a
    reader marking it used under the same lock comes wholly before (and keeps it) or wholly after
    (and finds it gone).
    """
    now = time.time()
    await asyncio.to_thread(blobs.remove_stale_temp, now)
    removed = []
    for digest in blobs.digests():
        async with blobs.locks.hold(digest):
            if await asyncio.to_thread(blobs.delete_if_unused_since, digest, now - max_idle_s):
                removed.append(digest)
    if removed:
        logger.info("removed the files of %d adapters no request used for %.0f hours from %s",
                    len(removed), max_idle_s / 3600, blobs.root)


def _rename_unless_present(src: Path, dst: Path) -> bool:
    """Rename folder `src` to `dst`; False if `dst` is a folder already."""
    try:
        os.rename(src, dst)
        return True
    except OSError:  # ENOTEMPTY/EEXIST: `dst` exists
        if not dst.is_dir():
            raise
        return False


def _holds(folder: Path, digest: str, names: Sequence[str]) -> bool:
    """Whether `folder` has all the named files, hashing to `digest`."""
    try:
        return digest_files(folder, names) == digest
    except FileNotFoundError:
        return False


def _place(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.link(src, dst)
            return
        except OSError:  # another file system (EXDEV), or one without hard links
            pass
    shutil.copyfile(src, dst)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
