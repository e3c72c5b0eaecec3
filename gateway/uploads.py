"""Reading an adapter upload into a private folder, with every limit enforced while it streams in.

The body is multipart/form-data with the text fields `name` and `base_model`, and either the
file parts `adapter_config.json` and `adapter_model.safetensors` or one part `file` holding a
tar (optionally gzipped) of the adapter folder; each part once. Files are written under fixed
names into a fresh temporary folder: nothing the client names (part file names, archive paths)
ever becomes a path.
Validation of the adapter itself is the engine's (EngineClient.check_adapter); this module only
makes sure the two files arrive, complete and within the size limit, or says that the server has
no disk space left to take them.
"""

from __future__ import annotations

import asyncio
import bz2
import contextlib
import gzip
import io
import logging
import lzma
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import Message

from gateway.errors import ApiError, invalid_request, quoted, refused_when_out_of_space
from store.blobs import ADAPTER_FILES, is_out_of_space

logger = logging.getLogger(__name__)

ARCHIVE_PART = "file"
_TEXT_FIELDS = ("name", "base_model")
# The parser's bound on file parts and on text fields, each. The form takes 3 parts at most, but a
# part it does not take (a checkpoint folder's README.md, a text field sent as a file with curl -F
# name=@x) is refused below by name, which the parser's "Too many files" does not say. The body's
# own bound caps the bytes of all parts together.
_MAX_FORM_PARTS = 32
_MAX_TEXT_FIELD_BYTES = 64 * 1024
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_WEIGHTS_FILE = "adapter_model.safetensors"
_WEIGHTS_STEM = PurePosixPath(_WEIGHTS_FILE).stem
# Members an archive may hold: files (links included) and, apart, folders (`tar -C folder .`
# writes one for the folder itself and one for each subfolder).
_MAX_ARCHIVE_FILES = _MAX_ARCHIVE_FOLDERS = 1000
_COPY_CHUNK = 1 << 20
# What a tar adds around its members' data: three 512-byte blocks per member (a header; in pax
# format, as `tar --format=posix` and macOS tar write, an extended header with its data block too;
# long names take more, and are counted as they are read) and the end-of-archive padding.
_TAR_OVERHEAD = 3 * tarfile.BLOCKSIZE * (_MAX_ARCHIVE_FILES + _MAX_ARCHIVE_FOLDERS + 20)
# How much of an archive's members other than the adapter files (the rest of a Trainer checkpoint
# folder: optimizer.pt holds about twice the adapter's weights, tokenizer files tens of MB) is
# read through, as a multiple of --max-upload-size and at least: they are never written, but a
# small archive could inflate to terabytes of them.
_SKIPPED_BYTES_FACTOR = 4
_MIN_SKIPPED_BYTES = 64 << 20
# The form around the files: part headers, boundaries and the text fields (each at most 64 KiB).
_FORM_OVERHEAD = 256 * 1024
# Where an upload is written on its way in: starlette spools a file part past 1 MiB to the
# temporary folder; then the files are written to a folder in the adapter folder.
_SPOOL_FOLDER = "the temporary folder (TMPDIR) where uploads are spooled"
ADAPTER_FOLDER = "the adapter folder (--adapter-dir)"
RECEIVE = "receive this upload"
_USAGE = ("send multipart/form-data with the fields 'name' and 'base_model' and either the files "
          "'adapter_config.json' and 'adapter_model.safetensors' or one 'file' with a .tar.gz of "
          "the adapter folder")


@dataclass(frozen=True)
class AdapterUpload:
    """An upload's fields, and the folder holding its two adapter files."""

    name: str
    base_model: str
    folder: Path


class _BodyTooLarge(Exception):
    pass


@contextlib.asynccontextmanager
async def read_adapter_upload(request: Request, max_bytes: int,
                              staging: Path) -> AsyncIterator[AdapterUpload]:
    """The upload of `request`, its files in a new folder under `staging` removed on exit.

    Raises ApiError: 413 past `max_bytes` of adapter files (sent, or unpacked from an archive) or
    past max_body_bytes, 400 for anything that is not the documented form, 503 `disk_full` while the
    server has no disk space to write it.
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip()
    if media_type.lower() != "multipart/form-data":  # media types are case-insensitive
        raise invalid_request(f"adapter uploads are multipart: {_USAGE}", code="invalid_upload")
    body_limit = max_body_bytes(max_bytes)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_limit:
        raise _body_too_large(max_bytes)
    capped = Request(request.scope, _capped_receive(request, body_limit))
    try:
        with refused_when_out_of_space(RECEIVE, _SPOOL_FOLDER, tempfile.gettempdir()):
            form = await capped.form(max_files=_MAX_FORM_PARTS, max_fields=_MAX_FORM_PARTS,
                                     max_part_size=_MAX_TEXT_FIELD_BYTES)
    except _BodyTooLarge:
        raise _body_too_large(max_bytes) from None
    except HTTPException as error:  # how starlette reports a form it cannot parse
        detail = error.detail.rstrip(".")
        if detail.startswith("Part exceeded maximum size"):
            # NOTE: a file's part sent without a filename (requests' files={name: (None, data)})
            # is read as a text field, which a file of weights always outgrows.
            detail += (f" (a part without a filename is a text field, and the text fields "
                       f"{' and '.join(map(quoted, _TEXT_FIELDS))} are short: send the adapter's "
                       "files, or its archive, as files, with a filename)")
        raise invalid_request(f"{detail}: {_USAGE}", code="invalid_upload") from None
    folder: Path | None = None
    try:
        _refuse_repeated_parts(form)
        fields = {key: value for key, value in form.multi_items() if isinstance(value, str)}
        files = {key: value for key, value in form.multi_items() if not isinstance(value, str)}
        _refuse_files_sent_as_text(fields)
        _refuse_unknown_fields(fields)
        _refuse_text_sent_as_files(files)
        with refused_when_out_of_space(RECEIVE, ADAPTER_FOLDER, staging):
            folder = Path(tempfile.mkdtemp(prefix=".tmp-upload-", dir=staging))
            await asyncio.to_thread(_write_files, files, folder, max_bytes)
        yield AdapterUpload(_field(fields, "name"), _field(fields, "base_model"), folder)
    finally:
        await form.close()
        if folder is not None:
            await asyncio.to_thread(shutil.rmtree, folder, True)


def _max_skipped_bytes(max_bytes: int) -> int:
    return max(_SKIPPED_BYTES_FACTOR * max_bytes, _MIN_SKIPPED_BYTES)


def max_body_bytes(max_bytes: int) -> int:
    """The largest body read: the adapter files (`max_bytes`), and an archive's other members,
    which only an archive may hold and which may not compress (optimizer.pt), with its headers."""
    return max_bytes + _max_skipped_bytes(max_bytes) + _TAR_OVERHEAD + _FORM_OVERHEAD


def _capped_receive(request: Request, max_bytes: int):
    """`receive` of `request`, raising _BodyTooLarge once the body passes `max_bytes`
    (a chunked body has no Content-Length to refuse up front)."""
    received = 0

    async def receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > max_bytes:
                raise _BodyTooLarge
        return message

    return receive


def _refuse_repeated_parts(form: FormData) -> None:
    """Each part may come once: which of two `name` fields (or files) was meant is a guess."""
    names = [name for name, _ in form.multi_items()]
    repeated = next((name for name in names if names.count(name) > 1), None)
    if repeated is not None:
        raise invalid_request(f"the form has the part {quoted(repeated)} more than once; send it once: "
                              f"{_USAGE}", param=repeated, code="invalid_upload")


def _refuse_files_sent_as_text(fields: dict[str, str]) -> None:
    """A file's part sent without a filename (as `requests.post(data=...)` sends one) arrives as
    a text field: say so, where the upload would be refused for lacking the file."""
    for name in fields:
        if name in (*ADAPTER_FILES, ARCHIVE_PART):
            raise invalid_request(f"the part '{name}' came as a text field; send it as a file, "
                                  f"with a filename (curl -F '{name}=@PATH'): {_USAGE}",
                                  param=name, code="invalid_upload")


def _refuse_unknown_fields(fields: dict[str, str]) -> None:
    """A field the upload does not read (a misspelt name, an option it has not) is refused, as
    the admin API refuses unknown JSON fields: ignored, it would seem to have been applied."""
    for name in fields:
        if name not in _TEXT_FIELDS:
            raise invalid_request(f"unexpected form field {quoted(name)}: {_USAGE}", param=name,
                                  code="invalid_upload")


def _refuse_text_sent_as_files(files: dict[str, UploadFile]) -> None:
    """The other way round: a text field sent as a file (with a filename)."""
    for name in _TEXT_FIELDS:
        if name in files:
            raise invalid_request(f"the field '{name}' came as a file; send it as text "
                                  f"(curl -F '{name}=VALUE'): {_USAGE}", param=name,
                                  code="invalid_upload")


def _field(fields: dict[str, str], name: str) -> str:
    value = fields.get(name, "").strip()
    if not value:
        raise invalid_request(f"the form field '{name}' is missing: {_USAGE}", param=name,
                              code="invalid_upload")
    return value


def _write_files(files: dict[str, UploadFile], folder: Path, max_bytes: int) -> None:
    """Put the two adapter files of the form's file parts into `folder`, under fixed names."""
    for part in files:
        if part.endswith(_PICKLE_SUFFIXES):
            raise _pickle_refused(part)
        if part not in (*ADAPTER_FILES, ARCHIVE_PART):
            raise invalid_request(f"unexpected file part {quoted(part)}: {_USAGE}", param=part,
                                  code="invalid_upload")
    if ARCHIVE_PART in files:
        if len(files) > 1:
            raise invalid_request(f"send either the archive or the two files, not both: {_USAGE}",
                                  code="invalid_upload")
        _extract_archive(files[ARCHIVE_PART].file, folder, max_bytes)
        return
    _require_both(set(files), "the upload")
    if sum(files[name].size or 0 for name in ADAPTER_FILES) > max_bytes:
        raise _too_large(max_bytes)
    for name in ADAPTER_FILES:
        with open(folder / name, "wb") as out:
            shutil.copyfileobj(files[name].file, out, _COPY_CHUNK)


def _extract_archive(archive: BinaryIO, folder: Path, max_bytes: int) -> None:
    """Copy the adapter files out of a tar(.gz) stream; other members (a Trainer checkpoint's
    optimizer.pt and training_args.bin included) are skipped, never read or written. An archive
    whose weights are only a pickle (adapter_model.bin) is refused as pickle_not_allowed.

    The adapter files count against `max_bytes`, as uploaded as two files; the members skipped
    against a bound of their own (see _SKIPPED_BYTES_FACTOR), and the tar headers (tarfile reads a
    long name's or a pax header's data whole) against _TAR_OVERHEAD: so a small archive that
    inflates to a huge one is refused before it is unpacked or held in memory.
    """
    found: set[str] = set()
    pickled_weights: str | None = None  # e.g. "adapter_model.bin", saved without safetensors
    adapter_bytes = skipped_bytes = 0
    max_skipped_bytes = _max_skipped_bytes(max_bytes)
    counts = {"files": 0, "folders": 0}
    bounds = {"files": _MAX_ARCHIVE_FILES, "folders": _MAX_ARCHIVE_FOLDERS}
    try:
        inflated = _HeadersCapped(_decompressed(archive))
        with tarfile.open(fileobj=inflated, mode="r|") as tar:
            for member in tar:
                path = PurePosixPath(member.name)
                if path.is_absolute() or ".." in path.parts:
                    raise invalid_request(f"the archive holds the unsafe path {quoted(member.name)}; "
                                          "pack the adapter folder with relative paths",
                                          code="invalid_upload")
                kind = "folders" if member.isdir() else "files"
                counts[kind] += 1
                if counts[kind] > bounds[kind]:
                    raise invalid_request(
                        f"the archive holds more than {bounds[kind]} {kind}; pack only the "
                        f"adapter folder, or upload {' and '.join(ADAPTER_FILES)} as two files",
                        code="invalid_upload")
                if member.issparse():
                    # NOTE: its size is the file's with its holes, not the data the archive holds:
                    # counted as read, the headers after it could take that much memory.
                    raise invalid_request(f"{quoted(member.name)} in the archive is a sparse file; "
                                          "pack it without --sparse (`tar czf adapter.tar.gz -C "
                                          "<adapter folder> .`)", code="invalid_upload")
                # NOTE: the data tarfile reads; a folder's or a link's header may claim a size
                # it reads none of: counted as read, the headers after it could take that much.
                size = max(member.size, 0) if _has_data(member) else 0
                inflated.expect_data(size)
                name = path.name
                if name not in ADAPTER_FILES or member.isdir():
                    # README.md, a Trainer checkpoint's optimizer.pt and the like: not needed, never
                    # read or written. A pickle of the weights is remembered for the refusal below.
                    skipped_bytes += size
                    if skipped_bytes > max_skipped_bytes:
                        raise _too_much_skipped(max_skipped_bytes)
                    if PurePosixPath(name).stem == _WEIGHTS_STEM and name.endswith(_PICKLE_SUFFIXES):
                        pickled_weights = pickled_weights or member.name
                    continue
                adapter_bytes += size
                if adapter_bytes > max_bytes:
                    raise _too_large(max_bytes)
                if not member.isfile():
                    raise invalid_request(f"{quoted(member.name)} in the archive is a link or a special "
                                          "file; pack the files themselves", code="invalid_upload")
                if name in found:
                    raise invalid_request(f"the archive holds {name} twice; pack one adapter "
                                          "folder", code="invalid_upload")
                found.add(name)
                source = tar.extractfile(member)
                with source, open(folder / name, "wb") as out:
                    shutil.copyfileobj(source, out, _COPY_CHUNK)
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as error:
        if is_out_of_space(error):  # the server's disk, not the archive, is at fault
            raise
        raise invalid_request(f"the 'file' part is not a readable .tar.gz ({error}); create it "
                              "with `tar czf adapter.tar.gz -C <adapter folder> .`",
                              code="invalid_upload") from None
    if pickled_weights is not None and _WEIGHTS_FILE not in found:
        raise _pickle_refused(pickled_weights)
    _require_both(found, "the archive")


def _has_data(member: tarfile.TarInfo) -> bool:
    """Whether tarfile reads the data its header claims (as TarInfo._proc_builtin decides)."""
    return member.isreg() or member.type not in tarfile.SUPPORTED_TYPES


def _too_much_skipped(max_skipped_bytes: int) -> ApiError:
    return ApiError(413, f"the archive holds more than {max_skipped_bytes} bytes of files other "
                    f"than the adapter's, more than this server reads through; pack only "
                    f"{' and '.join(ADAPTER_FILES)} (`tar czf adapter.tar.gz -C <adapter folder> "
                    f"{' '.join(ADAPTER_FILES)}`)", code="upload_too_large")


def _decompressed(archive: BinaryIO) -> BinaryIO:
    """The tar stream inside `archive`: gunzipped (bz2, xz) when it is compressed, by its magic."""
    magic = archive.read(6)
    archive.seek(0)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=archive, mode="rb")
    if magic.startswith(b"BZh"):
        return bz2.BZ2File(archive)
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(archive)
    return archive


class _HeadersCapped(io.RawIOBase):
    """A tar stream that refuses (413) to give more than _TAR_OVERHEAD bytes of `source` besides
    the data of the members read so far (see expect_data): those are its headers."""

    def __init__(self, source: BinaryIO):
        self._source = source
        self._limit = _TAR_OVERHEAD
        self._count = 0

    def expect_data(self, size: int) -> None:
        """Allow the data of a member of `size` bytes (padded to whole 512-byte blocks) next."""
        self._limit += -(-size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._source.read(self._limit - self._count + 1 if size < 0 else size)
        self._count += len(data)
        if self._count > self._limit:
            raise ApiError(413, f"the archive's tar headers (long file names, pax extended "
                           f"headers) take more than {_TAR_OVERHEAD} bytes; pack only the adapter "
                           f"folder, with short names", code="upload_too_large")
        return data


def _require_both(found: set[str], where: str) -> None:
    missing = [name for name in ADAPTER_FILES if name not in found]
    if missing:
        raise invalid_request(f"{where} lacks {' and '.join(missing)}: a PEFT adapter folder "
                              "(save_pretrained) has adapter_config.json and "
                              "adapter_model.safetensors", code="invalid_upload")


def _pickle_refused(name: str) -> ApiError:
    return invalid_request(f"{quoted(name)} is a pickle checkpoint, which this server never loads "
                           "(unpickling runs code); save the adapter with "
                           "save_pretrained(..., safe_serialization=True) and upload "
                           "adapter_model.safetensors", code="pickle_not_allowed")


def _too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the upload is larger than this server accepts ({max_bytes} bytes); "
                    "upload a smaller adapter or raise --max-upload-size", code="upload_too_large")


def _body_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"the upload is larger than this server reads ({max_body_bytes(max_bytes)} "
                    f"bytes: {max_bytes} of adapter files, --max-upload-size, and up to "
                    f"{_max_skipped_bytes(max_bytes)} of other files in an archive); upload a "
                    "smaller adapter, pack only its two files, or raise --max-upload-size",
                    code="upload_too_large")
