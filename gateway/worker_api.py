"""The internal HTTP API between gateways and engine workers: its paths and bodies.

A worker serves one model. Gateways send the internal key (store.workers) as a bearer token.

- POST GENERATE_PATH, body GenerateBody: the answer is a stream of server-sent events, each a
  StreamLine: chunks, or one line that ends the stream: `rejected` (the engine refused the
  request; before any chunk), `error` (the engine failed it) or `stopped` (the worker's graceful
  shutdown reached its deadline first: before any chunk, another worker may run the request as
  if it never came here). While the request waits (queued behind others, or between chunks), a
  comment line comes every KEEPALIVE_S, so that a gateway tells a busy worker from a hung one by
  silence alone. Refused before the stream starts, with an HTTP status and a WorkerError: 400
  `rejected` (a malformed body), 409 `adapter_missing` (send the adapter's files, then ask
  again), 404 `unknown_model`, 401 `unauthorized`, 503 `unavailable` (the worker is shutting
  down: it has left the registry already).
- PUT ADAPTERS_PATH/<digest>, multipart with the adapter's two files: the worker keeps them under
  their digest (checked) for the requests that name it.
- POST CHECK_ADAPTER_PATH, multipart with the two files: AdapterInfo, or 422 `adapter_rejected`.
  A query parameter MAX_LORA_RANK_PARAM above the worker's --max-lora-rank checks the adapter
  against that limit instead: that of another worker of the model, restarting.
- Either of those two answers 507 `disk_full` when the worker has no disk space left to take the
  files (in TMPDIR, where they arrive, or in its data folder, where they are kept).
"""

from __future__ import annotations

import msgspec

from gateway.engine_client import GenerationChunk, SamplingOptions

GENERATE_PATH = "/internal/generate"
KEEPALIVE_S = 2.0  # the longest a generate stream stays silent
ADAPTERS_PATH = "/internal/adapters"
CHECK_ADAPTER_PATH = "/internal/check-adapter"
MAX_LORA_RANK_PARAM = "max_lora_rank"
DISK_FULL = "disk_full"  # a WorkerError's kind (HTTP 507) for adapter files it has no room for


class GenerateBody(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    prompt_token_ids: list[int]
    options: SamplingOptions
    request_id: str
    tenant: str | None = None
    adapter: str | None = None  # the digest of the adapter to run with (its files are on the worker)


class WorkerError(msgspec.Struct, frozen=True):
    kind: str
    message: str
    param: str | None = None  # a refused request's field at fault (RequestRejected.param)


class StreamLine(msgspec.Struct, frozen=True, omit_defaults=True):
    chunk: GenerationChunk | None = None
    error: str | None = None  # the engine failed the request: it is gone
    rejected: WorkerError | None = None  # the engine refused the request (the first line)
    stopped: str | None = None  # the worker shut down before the request finished: it is gone
