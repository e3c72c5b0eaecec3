"""Adapter upload, use, versions and deletion through the real server, against PEFT's own outputs;
tenant isolation cell by cell; and bad uploads that must leave the store and blob folder unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gzip
import io
import itertools
import json
import logging
import os
import shutil
import sqlite3
import tarfile
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import pytest
import redis
import torch

from gateway.errors import REDIS_FULL_MESSAGE
from gateway.uploads import max_body_bytes
from store.blobs import OWNER_FILE
from store.redis import RedisKeys
from store.sqlite import SqliteStore
from tests.conftest import (DEMO_MAX_LORA_RANK, DEMO_MODEL, NARROW_MAX_LORA_RANK, gateway_server,
                            logged_status, send_partly)
from tests.helpers import HeldEngine, fill_volume, hf_greedy, make_peft_model, small_volume, use_up_inodes
from tests.test_gateway_metrics import sample
from tests.test_gateway_routing import eventually
from tests.redis_server import redis_server, start_redis_server, stop_redis_server  # noqa: F401

MAX_UPLOAD_BYTES = 2 << 20
PROMPT = "Adapters change this"
NUM_TOKENS = 8
_names = itertools.count()


# Adapters: real PEFT folders over the demo model (and one over a different model).

def _demo_peft_model(demo_model_dir: Path, seed: int, **lora_kwargs):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(demo_model_dir).eval()
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(**lora_kwargs)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:  # PEFT initialises B to zero, which would make a no-op adapter
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
    return model


@pytest.fixture(scope="module")
def adapters(demo_model_dir, demo_engine, tmp_path_factory) -> dict[str, Path]:
    """name -> adapter folder; `expected` holds each good adapter's greedy tokens for PROMPT."""
    root = tmp_path_factory.mktemp("adapters")
    prompt = demo_engine.tokenize(PROMPT)
    folders, expected = {}, {}
    good = {
        "all-r8": dict(r=8, lora_alpha=16, target_modules="all-linear"),
        "attn-r4": dict(r=4, lora_alpha=4, use_rslora=True,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    }
    for seed, (name, lora) in enumerate(good.items(), start=1):
        model = _demo_peft_model(demo_model_dir, seed, **lora)
        model.save_pretrained(root / name)
        expected[name] = hf_greedy(model, prompt, NUM_TOKENS)[0]
        folders[name] = root / name
    with model.disable_adapter():
        expected["base"] = hf_greedy(model, prompt, NUM_TOKENS)[0]
    over_rank = _demo_peft_model(demo_model_dir, 9, r=2 * DEMO_MAX_LORA_RANK, lora_alpha=8,
                                 target_modules=["q_proj"])
    over_rank.save_pretrained(root / "over-rank")
    over_rank.save_pretrained(root / "pickled", safe_serialization=False)
    make_peft_model(seed=3, model_overrides={"num_hidden_layers": 4}).save_pretrained(
        root / "other-base")  # the same layers and module names, another model's shapes
    folders.update({n: root / n for n in ("over-rank", "pickled", "other-base")})
    folders["expected"] = expected
    return folders


# Servers and clients.

@pytest.fixture(scope="module", params=["sqlite", "redis"])
def server(request, demo_engine, tmp_path_factory):
    store_url = request.getfixturevalue("redis_server") if request.param == "redis" else None
    with gateway_server(demo_engine, tmp_path_factory.mktemp("adapters-gw"), store_url,
                        max_upload_bytes=MAX_UPLOAD_BYTES) as running:
        yield running


@pytest.fixture
def tenant(server) -> tuple[str, str]:
    name = f"t{next(_names)}"
    return name, server.new_tenant(name)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def files_of(folder: Path) -> dict[str, tuple[str, bytes]]:
    return {name: (name, (folder / name).read_bytes())
            for name in ("adapter_config.json", "adapter_model.safetensors")}


def unique_files(folder: Path) -> dict:
    """The adapter's files with a config no other upload has (a new digest, the same weights)."""
    return _with_config(folder, lora_dropout=next(_names) / 1e6)


def upload(server, key: str, name: str, files: dict, base: str = DEMO_MODEL,
           path: str = "/v1/adapters") -> httpx.Response:
    return httpx.post(server.url + path, data={"name": name, "base_model": base}, files=files,
                      headers=auth(key), timeout=60)


def tar_gz(members: dict[str, bytes | None], tar_format: int = tarfile.DEFAULT_FORMAT,
           pax_headers: dict[str, str] | None = None) -> bytes:
    """A .tar.gz of `members` (name -> data; None: a folder), each with `pax_headers`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tar_format) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, data = tarfile.DIRTYPE, b""
            info.size = len(data)
            info.pax_headers = pax_headers or {}
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def sparse_then(real_size: int, members: dict[str, bytes]) -> bytes:
    """A .tar.gz whose first member is a GNU sparse file (`tar --sparse`) of `real_size` bytes,
    all of them a hole (the archive holds none of its data), then `members`."""
    info = tarfile.TarInfo("holes.bin")
    info.type = tarfile.GNUTYPE_SPARSE
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[483:495] = tarfile.itn(real_size, 12, tarfile.GNU_FORMAT)  # the file's own size
    header[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(header))[0]
    rest = io.BytesIO()
    with tarfile.open(fileobj=rest, mode="w") as tar:
        for name, data in members.items():
            member = tarfile.TarInfo(name)
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return gzip.compress(bytes(header) + rest.getvalue())


def claims_then(member_type: bytes, claimed_size: int, members: dict[str, bytes]) -> bytes:
    """A .tar.gz whose first member, of `member_type` (a folder, a link), claims `claimed_size`
    bytes of data in its header though tarfile reads none for that type, then `members` (GNU
    format: a long name is a header of its own)."""
    info = tarfile.TarInfo("claims")
    info.type = member_type
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[124:136] = tarfile.itn(claimed_size, 12, tarfile.GNU_FORMAT)
    header[148:156] = b"%06o\0 " % tarfile.calc_chksums(bytes(header))[0]
    return gzip.compress(bytes(header) + gzip.decompress(tar_gz(members, tarfile.GNU_FORMAT)))


def greedy_ids(server, key: str, model: str, answered_by: str | None = None) -> list[int]:
    """The gateway's greedy tokens for PROMPT, as ids, through the official client; the reply
    names `answered_by` (default: `model`)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0, logprobs=0,
        extra_body={"min_tokens": NUM_TOKENS, "return_tokens_as_token_ids": True})
    assert completion.model == (answered_by or model)
    return [int(t.removeprefix("token_id:")) for t in completion.choices[0].logprobs.tokens]


def models_of(server, key: str) -> dict[str, dict]:
    listed = httpx.get(server.url + "/v1/models", headers=auth(key))
    assert listed.status_code == 200, listed.text
    return {card["id"]: card for card in listed.json()["data"]}


# Upload and use.

def test_uploaded_adapters_answer_as_peft_does(server, tenant, adapters):
    name, key = tenant
    expected = adapters["expected"]
    created = upload(server, key, "support-bot", files_of(adapters["all-r8"]))
    assert created.status_code == 201, created.text
    record = created.json()
    assert (record["id"], record["model"], record["tenant"], record["base_model"],
            record["version"]) == ("support-bot", "support-bot", name, DEMO_MODEL, 1)
    assert record["rank"] == 8 and len(record["target_modules"]) == 7
    archive = tar_gz({f"attn/{f}": data for f, (_, data) in files_of(adapters["attn-r4"]).items()})
    created = upload(server, key, "attn", {"file": ("attn.tar.gz", archive)})
    assert created.status_code == 201, created.text
    assert created.json()["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]

    cards = models_of(server, key)
    assert cards[DEMO_MODEL]["parent"] is None
    assert cards["support-bot"]["parent"] == DEMO_MODEL and cards["support-bot"]["owned_by"] == name
    assert greedy_ids(server, key, "support-bot") == expected["all-r8"]
    assert greedy_ids(server, key, f"{DEMO_MODEL}:support-bot") == expected["all-r8"]
    assert greedy_ids(server, key, "attn") == expected["attn-r4"]
    assert greedy_ids(server, key, DEMO_MODEL) == expected["base"]
    assert expected["all-r8"] != expected["base"] != expected["attn-r4"]
    metrics = server.admin("GET", "/metrics").text
    misses = [line for line in metrics.splitlines()
              if line.startswith("switchboard_adapter_cache_misses_total{")]
    assert misses and float(misses[0].split()[-1]) >= 1  # both adapters were paged in
    loads = [line for line in metrics.splitlines()
             if line.startswith("switchboard_adapter_disk_loads_total{")]
    assert loads and float(loads[0].split()[-1]) >= 2  # and read from their files
    assert "switchboard_adapter_cache_hits_total{" in metrics


def test_an_archive_of_a_trainer_checkpoint_uploads_its_safetensors(server, tenant, adapters):
    _, key = tenant
    pickled = adapters["pickled"] / "adapter_model.bin"  # any pickle: it must never be read
    members = {f"checkpoint-500/{f}": data for f, (_, data) in files_of(adapters["attn-r4"]).items()}
    # optimizer.pt holds about twice the adapter's weights: skipped, it does not count against
    # --max-upload-size (it once made such an archive "larger than this server accepts"), nor
    # does its part of the body: Adam's moments hardly compress.
    members |= {"checkpoint-500/training_args.bin": pickled.read_bytes(),
                "checkpoint-500/optimizer.pt": pickled.read_bytes() + os.urandom(2 * MAX_UPLOAD_BYTES)}
    archive = tar_gz(members)
    assert len(archive) > 2 * MAX_UPLOAD_BYTES
    created = upload(server, key, "trained", {"file": ("ckpt.tar.gz", archive)})
    assert created.status_code == 201, created.text
    assert greedy_ids(server, key, "trained") == adapters["expected"]["attn-r4"]


def test_an_archive_of_1000_files_in_pax_format_uploads(server, tenant, adapters):
    """As `tar --format=posix -C folder .` packs it (and macOS tar a folder whose files have
    extended attributes): each member has an extended header of its own. It was refused as a 413
    blaming long file names from some 680 members on. The folder entries (`./`, `./runs/`) are no
    files: they were counted as files, and 1000 files were refused as more than 1000."""
    _, key = tenant
    members = {"./": None,
               **{f"./{n}": d for n, (_, d) in files_of(adapters["attn-r4"]).items()},
               "./runs/": None, **{f"./runs/events.{i}": b"" for i in range(998)}}
    archive = tar_gz(members, tarfile.PAX_FORMAT,
                     {"atime": "1763800000.123456789", "ctime": "1763800000.123456789"})
    created = upload(server, key, "pax", {"file": ("a.tar.gz", archive)})
    assert created.status_code == 201, created.text
    assert greedy_ids(server, key, "pax") == adapters["expected"]["attn-r4"]


def test_streamed_chat_with_an_adapter(server, tenant, adapters):
    _, key = tenant
    assert upload(server, key, "chatty", files_of(adapters["attn-r4"])).status_code == 201
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    stream = client.chat.completions.create(
        model="chatty", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens >= 1
    assert all(c.model == "chatty" for c in chunks)


def test_metrics_count_adapter_calls_under_their_base_model(server, tenant, adapters):
    """However many adapter names a tenant uploads (the same files: no bytes more) and calls,
    as `name` or `base:name`, /metrics holds no more series, and names none."""
    name, key = tenant
    files = files_of(adapters["attn-r4"])

    def use_adapter(adapter: str) -> None:
        assert upload(server, key, adapter, files).status_code == 201
        for model in (adapter, f"{DEMO_MODEL}:{adapter}"):
            reply = httpx.post(server.url + "/v1/completions", headers=auth(key), timeout=60,
                               json={"model": model, "prompt": PROMPT, "max_tokens": 1})
            assert reply.status_code == 200, reply.text

    def scrape() -> tuple[str, set[str]]:
        text = server.admin("GET", "/metrics").text
        return text, {line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}

    def counted(num_requests: int) -> bool:
        # NOTE: a request is counted once its response is sent: the last one may come after.
        return eventually(lambda: sample(scrape()[0], "switchboard_requests_total", tenant=name,
                                         model=DEMO_MODEL, status=200) == num_requests)

    use_adapter("labelled-0")
    assert counted(2)
    _, series = scrape()
    for i in range(1, 4):
        use_adapter(f"labelled-{i}")
    assert counted(8)
    text, grown = scrape()
    assert grown == series and "labelled-" not in text
    assert sample(text, "switchboard_generation_tokens_total", tenant=name, model=DEMO_MODEL) == 8


def test_reupload_makes_a_new_version_that_requests_use(server, tenant, adapters):
    name, key = tenant
    expected = adapters["expected"]
    first = upload(server, key, "bot", files_of(adapters["all-r8"])).json()
    assert greedy_ids(server, key, "bot") == expected["all-r8"]
    second = upload(server, key, "bot", files_of(adapters["attn-r4"]))
    assert second.status_code == 201 and second.json()["version"] == 2
    assert second.json()["digest"] != first["digest"]
    assert greedy_ids(server, key, "bot") == expected["attn-r4"]  # the new files, not old slots
    latest = httpx.get(server.url + "/v1/adapters/bot", headers=auth(key)).json()
    assert latest["version"] == 2
    old = httpx.get(server.url + "/v1/adapters/bot?version=1", headers=auth(key)).json()
    assert old["digest"] == first["digest"]
    for bad in ("0", "x", "\u0661", "9" * 20):  # an Arabic-Indic one; beyond a 64-bit integer
        response = httpx.get(server.url + "/v1/adapters/bot", params={"version": bad}, headers=auth(key))
        assert (response.status_code, response.json()["error"]["param"]) == (400, "version"), bad
    listed = httpx.get(server.url + "/v1/adapters", headers=auth(key)).json()["data"]
    assert [(a["id"], a["version"]) for a in listed] == [("bot", 2)]


def test_uploading_the_files_again_repairs_a_damaged_stored_copy(server, tenant, adapters):
    _, key = tenant
    files = unique_files(adapters["all-r8"])
    digest = upload(server, key, "rotted", files).json()["digest"]
    weights = server.app.state.gateway.blobs.path(digest) / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF  # bit rot in the stored copy
    weights.chmod(0o644)
    weights.write_bytes(bytes(data))
    if server.app.state.gateway.store.shared_blobs is not None:
        # Redis keeps a copy: the gateway's own is a cache, fetched again within the call.
        assert greedy_ids(server, key, "rotted") == adapters["expected"]["all-r8"]
        return
    with pytest.raises(openai.InternalServerError) as failed:
        greedy_ids(server, key, "rotted")
    message = failed.value.body["message"]
    assert "the adapter's stored copy holds files of digest " in message, message
    assert "upload the adapter again" in message and "/tmp" not in message
    again = upload(server, key, "rotted", files)  # what the message asks for
    assert again.status_code == 201 and again.json()["digest"] == digest, again.text
    assert greedy_ids(server, key, "rotted") == adapters["expected"]["all-r8"]


def test_a_route_does_not_answer_a_call_of_an_adapter_whose_stored_copy_is_damaged(
        demo_engine, adapters, tmp_path):
    """`route:adapter` on a damaged copy with none to replace it fails as a call to the adapter
    does (500 naming the damage); another tier answered it, without the adapter, at its price."""
    from routing.routes import parse_routes
    from tests.conftest import serve_gateway
    from tests.helpers import damage_adapter_files

    engines = {DEMO_MODEL: demo_engine, "large": demo_engine}
    routes = parse_routes({"keep": {"tiers": [DEMO_MODEL, "large"], "measure": "min_prob",
                                    "threshold": 0.0}}, engines)
    with serve_gateway(engines, tmp_path, routes=routes) as server:
        key = server.new_tenant("rotting")
        digest = upload(server, key, "bot", unique_files(adapters["all-r8"])).json()["digest"]
        damage_adapter_files(server.app.state.gateway.blobs.path(digest))
        replies = [httpx.post(server.url + "/v1/completions", headers=auth(key), timeout=60,
                              json={"model": model, "prompt": PROMPT, "max_tokens": 2})
                   for model in ("bot", "keep:bot")]
        stats = server.engine_metrics()
    direct, routed = replies
    assert (direct.status_code, routed.status_code) == (500, 500), routed.text
    assert routed.json() == direct.json()
    message = routed.json()["error"]["message"]
    assert "the adapter's stored copy holds files of digest " in message, message
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("gone", ["tenant made anew", "key revoked", "admin's tenant made anew"])
def test_an_upload_whose_tenant_or_key_went_while_it_streamed_stores_nothing(server, tenant, adapters,
                                                                             gone):
    name, _ = tenant
    key = server.admin("POST", f"/admin/tenants/{name}/keys").json()
    blobs_before = sorted(p.name for p in server.app.state.gateway.blobs.root.iterdir())
    path, credential = ("/v1/adapters", key["key"]) if gone != "admin's tenant made anew" else \
        (f"/admin/tenants/{name}/adapters", server.admin_key)
    request = httpx.Request("POST", server.url + path, data={"name": "late", "base_model": DEMO_MODEL},
                            files=unique_files(adapters["all-r8"]), headers=auth(credential))
    body, half_sent, acted = request.read(), threading.Event(), threading.Event()

    def slowly():
        yield body[:len(body) // 2]
        half_sent.set()
        acted.wait(30)  # the rest once the admin has acted (it once had 1 s to)
        yield body[len(body) // 2:]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sent = pool.submit(httpx.post, request.url, content=slowly(), headers=request.headers, timeout=60)
        assert half_sent.wait(30)
        try:
            if gone == "key revoked":
                assert server.admin("DELETE", f"/admin/keys/{key['id']}").status_code == 200
            else:
                assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
                assert server.admin("POST", "/admin/tenants", json={"name": name}).status_code == 201
        finally:
            acted.set()
        response = sent.result()
    assert response.status_code == (401 if gone != "admin's tenant made anew" else 404), response.text
    assert server.admin("GET", f"/admin/tenants/{name}/adapters").json()["data"] == []
    assert sorted(p.name for p in server.app.state.gateway.blobs.root.iterdir()) == blobs_before


def test_an_upload_the_locked_store_refuses_keeps_no_files(server, tenant, adapters):
    name, key = tenant
    state = server.app.state.gateway
    if not isinstance(state.store, SqliteStore):
        pytest.skip("another process's write lock is SQLite's")
    before = _snapshot(server, name)
    other = sqlite3.connect(state.store.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # an sqlite3 shell, a script's long write
        refused = upload(server, key, "locked-out", unique_files(adapters["all-r8"]))
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "store_unavailable"
    assert _snapshot(server, name) == before


def _refused_for_want_of_space(refused: httpx.Response, where: str) -> None:
    assert refused.status_code == 503, refused.text
    assert refused.json() == {"error": {
        "message": f"the server has no disk space left to receive this upload: the volume of {where} "
                   "is full; retrying will not help until the operator frees space there",
        "type": "server_error", "param": None, "code": "disk_full"}}
    assert "retry-after" not in refused.headers  # a full disk stays full until someone acts
    assert refused.headers["x-should-retry"] == "false"


def test_an_upload_with_no_room_to_be_spooled_is_refused_and_its_request_given_back(
        demo_engine, adapters, tmp_path, monkeypatch, caplog):
    """Starlette spools a file part past 1 MiB to the temporary folder (TMPDIR): with its volume
    full, the upload is told so, keeps nothing, and gives back its request against the rpm."""
    with small_volume(tmp_path / "tmp", "1m") as volume, \
            gateway_server(demo_engine, tmp_path / "data") as server:
        key = server.new_tenant("spooler", rpm=1)
        filler = fill_volume(volume)
        monkeypatch.setattr(tempfile, "tempdir", str(volume))  # as TMPDIR names it
        before = _snapshot(server, "spooler")
        files = {**files_of(adapters["all-r8"]),
                 "adapter_model.safetensors": ("adapter_model.safetensors", bytes(2 << 20))}
        with caplog.at_level(logging.WARNING, logger="gateway.errors"):
            refused = upload(server, key, "spooled", files)
        _refused_for_want_of_space(refused, "the temporary folder (TMPDIR) where uploads are spooled")
        assert f"where uploads are spooled, {volume}, has no room left: [Errno 28]" in caplog.text
        assert _snapshot(server, "spooler") == before
        filler.unlink()
        # An rpm of 1: the refused upload's request was given back.
        assert upload(server, key, "spooled", files_of(adapters["all-r8"])).status_code == 201


def test_an_upload_the_adapter_folder_has_no_room_for_is_refused_not_blamed_on_its_archive(
        demo_engine, adapters, tmp_path):
    with small_volume(tmp_path / "volume", "1m") as volume, \
            gateway_server(demo_engine, tmp_path / "data", adapter_dir=volume / "adapters") as server:
        key = server.new_tenant("packer", rpm=1)
        filler = fill_volume(volume)
        before = _snapshot(server, "packer")
        archive = tar_gz({name: data for name, (_, data) in files_of(adapters["all-r8"]).items()})
        refused = upload(server, key, "packed", {"file": ("adapter.tar.gz", archive)})
        _refused_for_want_of_space(refused, "the adapter folder (--adapter-dir)")
        assert _snapshot(server, "packer") == before
        filler.unlink()
        packed = upload(server, key, "packed", {"file": ("adapter.tar.gz", archive)})
        assert packed.status_code == 201, packed.text


def test_an_upload_whose_files_the_adapter_folder_has_no_inode_left_to_place_is_refused(
        demo_engine, adapters, tmp_path):
    """Staged under the adapter folder, an upload's files are linked into place: that takes no
    bytes, but a new folder for them, which a volume whose inodes are used up has no room for."""
    with small_volume(tmp_path / "volume", "4m", inodes=64) as volume, \
            gateway_server(demo_engine, tmp_path / "data", adapter_dir=volume / "adapters") as server:
        key = server.new_tenant("linker", rpm=1)
        before = _snapshot(server, "linker")
        fillers = use_up_inodes(volume, leave=3)  # the staging folder and its two files
        refused = upload(server, key, "linked", files_of(adapters["all-r8"]))
        _refused_for_want_of_space(refused, "the adapter folder (--adapter-dir)")
        assert _snapshot(server, "linker") == before
        shutil.rmtree(fillers)
        linked = upload(server, key, "linked", files_of(adapters["all-r8"]))
        assert linked.status_code == 201, linked.text  # its request was given back (rpm 1)


def test_uploads_with_a_tenant_key_count_against_its_rpm_and_the_admin_s_do_not(server, adapters):
    name = f"t{next(_names)}"
    key = server.new_tenant(name, rpm=1)
    refused = upload(server, key, "bad", files_of(adapters["all-r8"]), base="no-such-model")
    assert refused.status_code == 400, refused.text  # refused: its request is given back
    for i in range(2):
        by_admin = upload(server, server.admin_key, f"by-admin-{i}", unique_files(adapters["all-r8"]),
                          path=f"/admin/tenants/{name}/adapters")
        assert by_admin.status_code == 201, by_admin.text
    assert upload(server, key, "mine", unique_files(adapters["attn-r4"])).status_code == 201
    before = _snapshot(server, name)
    limited = upload(server, key, "one-too-many", unique_files(adapters["attn-r4"]))
    assert limited.status_code == 429, limited.text
    assert _snapshot(server, name) == before
    completion = httpx.post(server.url + "/v1/completions", headers=auth(key),
                            json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1})
    assert completion.status_code == 429  # one limit for uploads and calls, refused alike
    for refusal in (limited, completion):
        assert 1 <= int(refusal.headers["retry-after"]) <= 60
        error = refusal.json()["error"]
        assert (error["type"], error["code"], error["param"]) == \
            ("rate_limit_error", "rate_limit_exceeded", None)
        assert error["message"].startswith("rate limit reached: 1 requests per minute (rpm); retry in")


def test_the_storage_limit_refuses_the_upload_that_crosses_it_and_keeps_nothing_of_it(
        server, adapters, request):
    first, second, third = (unique_files(adapters["attn-r4"]) for _ in range(3))
    sizes = [sum(len(data) for _, data in files.values()) for files in (first, second, third)]
    limit = sizes[0] + max(sizes[1:])  # room for two of them
    name = f"t{next(_names)}"
    key = server.new_tenant(name, max_adapter_bytes=limit)
    assert upload(server, key, "bot", first).status_code == 201
    assert upload(server, key, "bot", second).json()["version"] == 2  # versions count too
    again = upload(server, key, "copy", first)  # files it stores already add nothing
    assert again.status_code == 201, again.text
    before, shared_before = _snapshot(server, name), _shared_copies(server, request)
    stored = sizes[0] + sizes[1]
    for path, credential in (("/v1/adapters", key), (f"/admin/tenants/{name}/adapters", server.admin_key)):
        refused = upload(server, credential, "bot", third, path=path)
        assert refused.status_code == 403, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["code"], error["param"]) == \
            ("insufficient_quota", "adapter_storage_exceeded", None)
        for words in (f"stores {stored} bytes", f"this upload adds {sizes[2]}",
                      f"limit of {limit} bytes", "delete adapters", "raise max_adapter_bytes"):
            assert words in error["message"], error["message"]
    assert _snapshot(server, name) == before  # no record, no files in the gateway's folder
    assert _shared_copies(server, request) == shared_before  # nor in Redis
    detail = server.admin("GET", f"/admin/tenants/{name}").json()
    assert (detail["tenant"]["max_adapter_bytes"], detail["adapter_bytes"]) == (limit, stored)
    assert httpx.delete(server.url + "/v1/adapters/bot", headers=auth(key)).status_code == 200
    assert upload(server, key, "bot", third).status_code == 201  # the second's bytes were freed
    assert server.admin("GET", f"/admin/tenants/{name}").json()["adapter_bytes"] == sizes[0] + sizes[2]


def test_the_storage_limit_counts_files_that_only_another_tenant_stores(server, adapters,
                                                                         monkeypatch):
    """Files another tenant stores count in full, and the upload is refused before an engine
    reads them: waived until the store's own check, they were checked and placed first, so a
    slower answer, or a 503 with no engine up, told the tenant that someone stores them."""
    files = unique_files(adapters["attn-r4"])
    size = sum(len(data) for _, data in files.values())
    assert upload(server, server.new_tenant(f"t{next(_names)}"), "theirs", files).status_code == 201
    engine = server.app.state.gateway.engines[DEMO_MODEL]
    checked, check = [], engine.check_adapter

    async def counted_check(folder: str):
        checked.append(folder)
        return await check(folder)

    monkeypatch.setattr(engine, "check_adapter", counted_check)
    key = server.new_tenant(f"t{next(_names)}", max_adapter_bytes=size - 1)
    refused = upload(server, key, "mine", files)
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["code"] == "adapter_storage_exceeded"
    assert "stores 0 bytes" in error["message"] and f"this upload adds {size}" in error["message"]
    assert checked == []
    assert httpx.get(server.url + "/v1/adapters", headers=auth(key)).json()["data"] == []


def _shared_copies(server, request) -> list[bytes]:
    """The keys of every adapter's files in Redis (none without a Redis store)."""
    if server.app.state.gateway.store.shared_blobs is None:
        return []
    client = redis.Redis.from_url(request.getfixturevalue("redis_server"))
    try:
        return sorted(client.scan_iter(match=RedisKeys("sb:").blob("*")))
    finally:
        client.close()


def test_an_upload_redis_has_no_room_for_keeps_nothing_and_others_go_on(demo_engine, adapters,
                                                                         tmp_path):
    """Out of its maxmemory halfway through an upload's files, Redis gets back what the upload
    staged: kept for the hour it is staged for, it would refuse every tenant's calls. The upload
    is told that the store is full, which a retry does not mend."""
    process, url = start_redis_server()
    client = redis.Redis.from_url(url)
    try:
        with gateway_server(demo_engine, tmp_path, url) as server:
            key, other = server.new_tenant("uploader"), server.new_tenant("other", rpm=100)
            # Once before, so what a tenant's first call keeps in Redis (its rate bucket, its
            # usage, the Lua scripts) is there already.
            assert greedy_ids(server, other, DEMO_MODEL) == adapters["expected"]["base"]
            # NOTE: chunks smaller than the weights, so the write fails past its first chunks, as
            # one of an adapter past 4 MiB does with the store's own.
            server.app.state.gateway.store.shared_blobs.chunk_bytes = 16 << 10
            client.config_set("maxmemory", client.info("memory")["used_memory"] + (384 << 10))
            refused = upload(server, key, "too-big", files_of(adapters["all-r8"]))  # 600 KB
            assert refused.status_code == 503, refused.text
            assert refused.json() == {"error": {"message": REDIS_FULL_MESSAGE, "type": "server_error",
                                                "param": None, "code": "store_full"}}
            assert "retry-after" not in refused.headers  # nothing mends it in a few seconds
            assert refused.headers["x-should-retry"] == "false"
            assert list(client.scan_iter(match="sb:blob*")) == []
            assert greedy_ids(server, other, DEMO_MODEL) == adapters["expected"]["base"]
            assert _snapshot(server, "uploader") == ([], [])
    finally:
        client.close()
        stop_redis_server(process)


def test_a_full_redis_still_lists_models_adapters_and_usage(demo_engine, adapters, tmp_path):
    """Redis out of its maxmemory refuses what would write (a call holds its budget), but reads
    go on: a tenant still sees its models and adapters, and the admin its usage. Read in a
    transaction, which a full Redis refuses even for reads, they answered 503 store_full."""
    process, url = start_redis_server()
    client = redis.Redis.from_url(url)
    try:
        with gateway_server(demo_engine, tmp_path, url) as server:
            key = server.new_tenant("reader")
            assert upload(server, key, "mine", files_of(adapters["attn-r4"])).status_code == 201
            auth = {"Authorization": f"Bearer {key}"}
            client.config_set("maxmemory", 1)
            models = httpx.get(server.url + "/v1/models", headers=auth, timeout=60)
            assert models.status_code == 200, models.text
            assert [m["id"] for m in models.json()["data"]] == [DEMO_MODEL, "mine"]
            listed = httpx.get(server.url + "/v1/adapters", headers=auth, timeout=60)
            assert (listed.status_code, [a["id"] for a in listed.json()["data"]]) == (200, ["mine"])
            detail = server.admin("GET", "/admin/tenants/reader")
            assert (detail.status_code, detail.json()["usage"]["requests"]) == (200, 0)
            refused = httpx.post(server.url + "/v1/completions", headers=auth, timeout=60,
                                 json={"model": DEMO_MODEL, "prompt": "hi", "max_tokens": 1})
            assert (refused.status_code, refused.json()["error"]["code"]) == (503, "store_full")
    finally:
        client.close()
        stop_redis_server(process)


def test_an_upload_past_its_tenant_s_limit_is_refused_before_it_reaches_redis(demo_engine,
                                                                              adapters, tmp_path):
    """An upload its tenant has no room for is refused before its files are placed: written to
    a Redis with no room for them first, it was told the store is full, which no retry mends,
    rather than that its tenant is past its storage limit."""
    process, url = start_redis_server()
    client = redis.Redis.from_url(url)
    files = files_of(adapters["all-r8"])  # 600 KB
    try:
        with gateway_server(demo_engine, tmp_path, url) as server:
            key = server.new_tenant("small", max_adapter_bytes=100 << 10)
            server.app.state.gateway.store.shared_blobs.chunk_bytes = 16 << 10  # as above
            client.config_set("maxmemory", client.info("memory")["used_memory"] + (384 << 10))
            refused = upload(server, key, "too-big", files)
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "adapter_storage_exceeded"
            assert "stores 0 bytes" in refused.json()["error"]["message"]
            assert list(client.scan_iter(match="sb:blob*")) == []
            assert _snapshot(server, "small") == ([], [])
    finally:
        client.close()
        stop_redis_server(process)


def test_delete_removes_the_adapter_and_unshared_files(server, adapters):
    blobs = server.app.state.gateway.blobs
    (_, key_a), (_, key_b) = _two_tenants(server)
    files = unique_files(adapters["all-r8"])
    digest = upload(server, key_a, "mine", files).json()["digest"]
    assert upload(server, key_b, "same-files", files).json()["digest"] == digest
    # It deletes every version: one that names a version is refused, not taken for that alone.
    one = httpx.delete(server.url + "/v1/adapters/mine?version=1", headers=auth(key_a))
    assert (one.status_code, one.json()["error"]["param"]) == (400, "version"), one.text
    assert httpx.get(server.url + "/v1/adapters/mine", headers=auth(key_a)).status_code == 200
    deleted = httpx.delete(server.url + "/v1/adapters/mine", headers=auth(key_a))
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert blobs.path(digest) is not None  # tenant B's record still references the files
    assert httpx.get(server.url + "/v1/adapters/mine", headers=auth(key_a)).status_code == 404
    with pytest.raises(openai.NotFoundError):
        greedy_ids(server, key_a, "mine")
    assert httpx.delete(server.url + "/v1/adapters/same-files", headers=auth(key_b)).status_code == 200
    assert blobs.path(digest) is None
    assert httpx.delete(server.url + "/v1/adapters/mine", headers=auth(key_a)).status_code == 404


def test_an_upload_of_the_files_a_delete_is_collecting_keeps_them(server, adapters, monkeypatch):
    """Tenant A deletes an adapter while tenant B uploads the same files: the delete finds that no
    record references them before B's record is written. B's 201 must still mean usable files."""
    state = server.app.state.gateway
    (_, key_a), (_, key_b) = _two_tenants(server)
    files = unique_files(adapters["all-r8"])
    digest = upload(server, key_a, "going", files).json()["digest"]
    checked, answered = threading.Event(), threading.Event()
    is_digest_referenced = state.store.is_digest_referenced

    async def referenced_then_wait(candidate: str) -> bool:
        referenced = await is_digest_referenced(candidate)
        if candidate == digest and not checked.is_set():
            checked.set()
            # The delete goes on once B's upload is answered, or once it has waited long enough
            # that the upload is surely waiting for the delete instead.
            await asyncio.to_thread(answered.wait, 3)
        return referenced

    monkeypatch.setattr(state.store, "is_digest_referenced", referenced_then_wait)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        deleted = pool.submit(httpx.delete, server.url + "/v1/adapters/going", headers=auth(key_a),
                              timeout=60)
        assert checked.wait(30)
        kept = upload(server, key_b, "staying", files)
        answered.set()
        assert deleted.result().status_code == 200
    assert kept.status_code == 201 and kept.json()["digest"] == digest, kept.text
    assert state.blobs.path(digest) is not None
    assert greedy_ids(server, key_b, "staying") == adapters["expected"]["all-r8"]


def test_deleting_a_tenant_collects_its_adapter_files(server, tenant, adapters):
    name, key = tenant
    digest = upload(server, key, "x", unique_files(adapters["attn-r4"])).json()["digest"]
    other = upload(server, server.new_tenant(f"t{next(_names)}"), "y", unique_files(adapters["all-r8"]))
    assert server.admin("DELETE", f"/admin/tenants/{name}").status_code == 200
    blobs = server.app.state.gateway.blobs
    assert blobs.path(other.json()["digest"]) is not None
    assert blobs.path(digest) is None


def _two_tenants(server) -> tuple[tuple[str, str], tuple[str, str]]:
    names = f"t{next(_names)}", f"t{next(_names)}"
    return tuple((n, server.new_tenant(n)) for n in names)


# Tenant isolation: every cell.

def test_tenant_b_can_never_reach_tenant_a_adapters(server, adapters):
    (a, key_a), (b, key_b) = _two_tenants(server)
    expected = adapters["expected"]
    record_a = upload(server, key_a, "private", files_of(adapters["all-r8"])).json()

    # List: neither /v1/adapters nor /v1/models shows it to B.
    assert httpx.get(server.url + "/v1/adapters", headers=auth(key_b)).json()["data"] == []
    assert "private" not in models_of(server, key_b)
    assert httpx.get(server.url + "/v1/models/private", headers=auth(key_b)).status_code == 404
    assert httpx.get(server.url + "/v1/models/private", headers=auth(key_a)).json()["parent"] == DEMO_MODEL
    # Get: unknown to B.
    assert httpx.get(server.url + "/v1/adapters/private", headers=auth(key_b)).status_code == 404
    # Use, by name and by base:adapter.
    for model in ("private", f"{DEMO_MODEL}:private"):
        with pytest.raises(openai.NotFoundError) as raised:
            greedy_ids(server, key_b, model)
        assert raised.value.body["code"] == "model_not_found"
    # Delete: 404, and A's adapter is untouched.
    assert httpx.delete(server.url + "/v1/adapters/private", headers=auth(key_b)).status_code == 404
    # Overwrite: B's upload under the same name is B's own adapter; A's is unchanged.
    mine = upload(server, key_b, "private", files_of(adapters["attn-r4"]))
    assert mine.status_code == 201 and mine.json()["tenant"] == b and mine.json()["version"] == 1
    assert greedy_ids(server, key_b, "private") == expected["attn-r4"]
    assert httpx.get(server.url + "/v1/adapters/private", headers=auth(key_a)).json() == record_a
    assert greedy_ids(server, key_a, "private") == expected["all-r8"]
    # The admin endpoints: the admin key reaches any tenant; a tenant key reaches none.
    admin_view = server.admin("GET", f"/admin/tenants/{a}/adapters/private")
    assert admin_view.status_code == 200 and admin_view.json() == record_a
    for method, path in (("GET", f"/admin/tenants/{a}/adapters"),
                         ("GET", f"/admin/tenants/{a}/adapters/private"),
                         ("DELETE", f"/admin/tenants/{a}/adapters/private")):
        refused = httpx.request(method, server.url + path, headers=auth(key_b))
        assert refused.status_code == 403, (method, path)
    refused = upload(server, key_b, "planted", files_of(adapters["all-r8"]),
                     path=f"/admin/tenants/{a}/adapters")
    assert refused.status_code == 403
    # The admin can upload into and delete from a tenant.
    planted = upload(server, server.admin_key, "by-admin", files_of(adapters["attn-r4"]),
                     path=f"/admin/tenants/{a}/adapters")
    assert planted.status_code == 201 and planted.json()["tenant"] == a
    assert greedy_ids(server, key_a, "by-admin") == expected["attn-r4"]
    assert server.admin("DELETE", f"/admin/tenants/{a}/adapters/by-admin").status_code == 200
    assert server.admin("GET", f"/admin/tenants/{b}/adapters").json()["data"][0]["tenant"] == b
    assert server.admin("GET", "/admin/tenants/nobody/adapters").status_code == 404


# Bad uploads: their own 4xx, and nothing kept.

def _truncated(folder: Path) -> dict:
    files = files_of(folder)
    name, data = files["adapter_model.safetensors"]
    files["adapter_model.safetensors"] = (name, data[: len(data) // 2])
    return files


def _with_config(folder: Path, **changes) -> dict:
    files = files_of(folder)
    config = json.loads(files["adapter_config.json"][1]) | changes
    files["adapter_config.json"] = ("adapter_config.json", json.dumps(config).encode())
    return files


BAD_UPLOADS = {
    # case: (build(adapters) -> (name, base, files), status, code, words in the message)
    "pickle weights": (lambda a: ("p", DEMO_MODEL, {
        "adapter_config.json": files_of(a["all-r8"])["adapter_config.json"],
        "adapter_model.bin": ("adapter_model.bin", (a["pickled"] / "adapter_model.bin").read_bytes())}),
        400, "pickle_not_allowed", "pickle"),
    "pickle in an archive": (lambda a: ("p", DEMO_MODEL, {"file": ("a.tar.gz", tar_gz({
        "adapter_config.json": (a["pickled"] / "adapter_config.json").read_bytes(),
        "adapter_model.bin": (a["pickled"] / "adapter_model.bin").read_bytes()}))}),
        400, "pickle_not_allowed", "pickle"),
    "truncated safetensors": (lambda a: ("t", DEMO_MODEL, _truncated(a["all-r8"])),
                              400, "invalid_adapter", "truncated"),
    "wrong shapes": (lambda a: ("w", DEMO_MODEL, files_of(a["other-base"])),
                     400, "invalid_adapter", "shape"),
    "rank over the limit": (lambda a: ("r", DEMO_MODEL, files_of(a["over-rank"])),
                            400, "invalid_adapter", "rank"),
    "unknown base model": (lambda a: ("u", "no-such-model", files_of(a["all-r8"])),
                           400, "model_not_found", "no-such-model"),
    "missing config": (lambda a: ("m", DEMO_MODEL, {
        "adapter_model.safetensors": files_of(a["all-r8"])["adapter_model.safetensors"]}),
        400, "invalid_upload", "adapter_config.json"),
    "path traversal name": (lambda a: ("../../etc/passwd", DEMO_MODEL, files_of(a["all-r8"])),
                            400, "invalid_name", "invalid adapter name"),
    # Its size was counted as data read, so the headers after it could take that much memory.
    "a sparse file in an archive": (lambda a: ("s", DEMO_MODEL, {"file": ("a.tar.gz", sparse_then(
        64 << 20, {n: d for n, (_, d) in files_of(a["all-r8"]).items()}))}),
        400, "invalid_upload", "is a sparse file"),
    # It was ignored, as if the upload had read it.
    "a field the upload does not read": (lambda a: ("f", DEMO_MODEL, {
        "rank": (None, "8"), **files_of(a["all-r8"])}), 400, "invalid_upload",
        "unexpected form field 'rank'"),
    "path traversal in an archive": (lambda a: ("p", DEMO_MODEL, {"file": ("a.tar.gz", tar_gz({
        f"../{n}": d for n, (_, d) in files_of(a["all-r8"]).items()}))}),
        400, "invalid_upload", "unsafe path"),
    "a name of 60000 characters": (lambda a: ("x" * 60000, DEMO_MODEL, files_of(a["all-r8"])),
                                   400, "invalid_name", "'xxxx"),
    "a base model's name": (lambda a: (DEMO_MODEL, DEMO_MODEL, files_of(a["all-r8"])),
                            400, "invalid_name", "base model"),
    "the name kept for routes": (lambda a: ("auto", DEMO_MODEL, files_of(a["all-r8"])),
                            400, "invalid_name", "kept for routing"),
    "over-size body": (lambda a: ("big", DEMO_MODEL, {
        **files_of(a["all-r8"]),
        "adapter_model.safetensors": ("adapter_model.safetensors", b"\0" * (MAX_UPLOAD_BYTES + 1))}),
        413, "upload_too_large", "larger"),
    "archive whose adapter files inflate past the limit": (lambda a: ("z", DEMO_MODEL, {"file": (
        "a.tar.gz", tar_gz({**{n: d for n, (_, d) in files_of(a["all-r8"]).items()},
                            "adapter_model.safetensors": b"\0" * (2 * MAX_UPLOAD_BYTES)}))}),
        413, "upload_too_large", "larger"),
    # Skipped, never written, but read through: a small archive must not take minutes of it.
    "archive whose other files inflate past what is read": (lambda a: ("z", DEMO_MODEL, {"file": (
        "a.tar.gz", tar_gz({**{n: d for n, (_, d) in files_of(a["all-r8"]).items()},
                            "README.md": b"\0" * ((64 << 20) + 1)}))}),
        413, "upload_too_large", "more than 67108864 bytes of files other than the adapter's"),
    # tarfile reads a long name's header data whole, outside any member's size: counted too.
    **{f"archive whose {kind} header inflates past the limit": (lambda a, kind=kind: ("z", DEMO_MODEL, {
        "file": ("a.tar.gz", tar_gz({**{n: d for n, (_, d) in files_of(a["all-r8"]).items()},
                                     "x" * (2 * MAX_UPLOAD_BYTES): b""}, tar_format))}),
        413, "upload_too_large", "tar headers (long file names, pax extended headers) take more than")
       for kind, tar_format in (("GNU long-name", tarfile.GNU_FORMAT), ("pax", tarfile.PAX_FORMAT))},
    # A folder's or a link's claimed size is no data tarfile reads: counted as read, it let the
    # long name after it take that much memory (a 1 MB upload took 3 GB).
    **{f"a {kind} claiming data, then a long name": (lambda a, member_type=member_type: (
        "z", DEMO_MODEL, {"file": ("a.tar.gz", claims_then(member_type, 32 << 20, {
            "x" * (16 << 20): b"", **{n: d for n, (_, d) in files_of(a["all-r8"]).items()}}))}),
        413, "upload_too_large", "tar headers (long file names, pax extended headers) take more than")
       for kind, member_type in (("folder", tarfile.DIRTYPE), ("symlink", tarfile.SYMTYPE))},
    # A small archive (it was refused as larger than the server accepts: raising the limit did
    # not help).
    "archive of over 1000 files": (lambda a: ("f", DEMO_MODEL, {"file": ("a.tar.gz", tar_gz({
        **{n: d for n, (_, d) in files_of(a["all-r8"]).items()},
        **{f"runs/events.{i}": b"" for i in range(1000)}}))}),
        400, "invalid_upload", "more than 1000 files; pack only the adapter folder"),
    "archive of over 1000 folders": (lambda a: ("f", DEMO_MODEL, {"file": ("a.tar.gz", tar_gz({
        **{n: d for n, (_, d) in files_of(a["all-r8"]).items()},
        **{f"runs/{i}/": None for i in range(1001)}}))}),
        400, "invalid_upload", "more than 1000 folders; pack only the adapter folder"),
    "corrupt archive": (lambda a: ("c", DEMO_MODEL, {"file": ("a.tar.gz", b"not a tar at all")}),
                        400, "invalid_upload", "tar.gz"),
    "regex too slow to match": (lambda a: ("x", DEMO_MODEL, _with_config(
        a["all-r8"], target_modules="(?:a?){60000}")), 400, "invalid_adapter", "too long to match"),
    "DoRA": (lambda a: ("d", DEMO_MODEL, _with_config(a["all-r8"], use_dora=True)),
             400, "invalid_adapter", "DoRA"),
    "PiSSA": (lambda a: ("p", DEMO_MODEL, _with_config(a["all-r8"], init_lora_weights="pissa")),
              400, "invalid_adapter", "path_initial_model_for_weight_conversion"),
    "scaling past float32": (lambda a: ("s", DEMO_MODEL, _with_config(a["all-r8"], lora_alpha=1e308)),
                             400, "invalid_adapter", "lower lora_alpha"),
}


def _snapshot(server, tenant: str):
    root = server.app.state.gateway.blobs.root
    records = server.admin("GET", f"/admin/tenants/{tenant}/adapters").json()["data"]
    return sorted(p.name for p in root.iterdir() if p.name != OWNER_FILE), records


@pytest.mark.parametrize("case", list(BAD_UPLOADS))
def test_bad_uploads_are_refused_and_keep_nothing(server, tenant, adapters, case):
    name, key = tenant
    build, status, code, words = BAD_UPLOADS[case]
    upload(server, key, "kept", files_of(adapters["attn-r4"]))  # state that must survive
    before = _snapshot(server, name)
    adapter_name, base, files = build(adapters)
    refused = upload(server, key, adapter_name, files, base=base)
    assert refused.status_code == status, refused.text
    error = refused.json()["error"]
    assert error["code"] == code and words.lower() in error["message"].lower(), error
    assert "/tmp" not in error["message"]  # server paths never leak
    assert len(error["message"]) < 600  # what the client sent is cut, not echoed whole
    assert _snapshot(server, name) == before
    assert greedy_ids(server, key, "kept") == adapters["expected"]["attn-r4"]  # still serving


def test_a_chunked_body_past_the_limit_is_cut_off(server, tenant, adapters):
    name, key = tenant
    before = _snapshot(server, name)

    def body():  # no Content-Length: the server must count as it reads
        yield b"--b\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nbig\r\n"
        yield (b"--b\r\nContent-Disposition: form-data; name=\"adapter_model.safetensors\"; "
               b"filename=\"w\"\r\nContent-Type: application/octet-stream\r\n\r\n")
        # Past what the server reads of a body (room for an archive's other files included).
        for _ in range((max_body_bytes(MAX_UPLOAD_BYTES) + MAX_UPLOAD_BYTES) // (64 << 10)):
            yield b"\0" * (64 << 10)
        yield b"\r\n--b--\r\n"

    refused = httpx.post(server.url + "/v1/adapters", content=body(), timeout=60,
                         headers={**auth(key), "Content-Type": "multipart/form-data; boundary=b"})
    assert refused.status_code == 413, refused.text
    assert "larger than this server reads" in refused.json()["error"]["message"]
    assert _snapshot(server, name) == before


def test_an_upload_whose_client_leaves_midway_is_a_499_and_keeps_nothing(server, tenant, caplog):
    name, key = tenant
    caplog.set_level(logging.INFO, logger="gateway.access")
    before = _snapshot(server, name)
    server.leave_while_sending(
        "/v1/adapters", {**auth(key), "Content-Type": "multipart/form-data; boundary=b"},
        b"--b\r\nContent-Disposition: form-data; name=\"name\"\r\n\r\nhalf\r\n--b\r\n"
        b"Content-Disposition: form-data; name=\"adapter_model.safetensors\"; filename=\"w\"\r\n"
        b"\r\n" + b"\0" * 1000, 100_000)
    assert logged_status(caplog, "POST", "/v1/adapters") == 499  # was a 500
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []  # and its traceback
    assert _snapshot(server, name) == before


def test_an_upload_whose_client_leaves_while_it_is_checked_is_a_499_and_keeps_nothing(
        server, tenant, adapters, caplog, monkeypatch):
    """A client that sent its whole body and left while the adapter was checked (seconds for a
    large one): its files were stored and served as the adapter's new version, logged as a 201."""
    name, key = tenant
    caplog.set_level(logging.INFO, logger="gateway.access")
    before = _snapshot(server, name)
    engine = server.app.state.gateway.engines[DEMO_MODEL]
    check, client_left = engine.check_adapter, threading.Event()

    async def check_once_the_client_left(folder: str):
        assert await asyncio.to_thread(client_left.wait, 30)
        return await check(folder)

    monkeypatch.setattr(engine, "check_adapter", check_once_the_client_left)
    form = httpx.Request("POST", server.url + "/v1/adapters", data={"name": "gone", "base_model": DEMO_MODEL},
                         files=unique_files(adapters["attn-r4"]))
    body = form.read()
    with send_partly(server.url, "/v1/adapters", {**auth(key), "Content-Type": form.headers["Content-Type"]},
                     body, len(body)):
        pass  # the whole body sent, the connection closed
    client_left.set()
    assert logged_status(caplog, "POST", "/v1/adapters") == 499
    assert _snapshot(server, name) == before


def test_uploads_need_multipart_and_both_fields(server, tenant, adapters):
    _, key = tenant
    as_json = httpx.post(server.url + "/v1/adapters", json={"name": "j"}, headers=auth(key))
    assert as_json.status_code == 400 and as_json.json()["error"]["code"] == "invalid_upload"
    no_base = httpx.post(server.url + "/v1/adapters", data={"name": "n"},
                         files=files_of(adapters["all-r8"]), headers=auth(key))
    assert no_base.status_code == 400 and no_base.json()["error"]["param"] == "base_model"
    anonymous = httpx.post(server.url + "/v1/adapters", data={"name": "n", "base_model": DEMO_MODEL},
                           files=files_of(adapters["all-r8"]))
    assert anonymous.status_code == 401


def _raw_form(body: bytes, content_type: str = "multipart/form-data; boundary=b") -> dict:
    return {"content": body, "headers": {"Content-Type": content_type}}


def _fields(**fields) -> dict:
    return {"data": {"name": "f", "base_model": DEMO_MODEL, **fields}}


FORMS = {
    # case: (build(adapters) -> httpx.post arguments, param, words in the message); all 400
    # invalid_upload. The parser's refusals:
    "no boundary": (lambda a: _raw_form(b"x", "multipart/form-data"), None, "boundary"),
    "no multipart framing": (lambda a: _raw_form(b"garbage\r\n\r\n"), None, "invalid multipart"),
    "a part without a name": (lambda a: _raw_form(b"--b\r\nX: y\r\n\r\nabc\r\n--b--\r\n"), None,
                              "content-disposition"),
    "too many file parts": (lambda a: {**_fields(), "files": [
        *((f"extra{i}", ("x", b"1")) for i in range(40)), *files_of(a["all-r8"]).items()]},
        None, "too many files"),
    "a field too large": (lambda a: {**_fields(name="x" * (70 << 10)), "files": files_of(a["all-r8"])},
                          None, "the text fields 'name' and 'base_model' are short"),
    # What requests sends for files={name: (None, data)}: a text field, too large for one.
    "a large file sent without a filename": (lambda a: {**_fields(), "files": {
        **files_of(a["all-r8"]), "adapter_model.safetensors": (
            None, (a["all-r8"] / "adapter_model.safetensors").read_bytes())}},
        None, "a part without a filename is a text field"),
    "too many fields": (lambda a: {**_fields(**{f"c{i}": "1" for i in range(40)}),
                                   "files": files_of(a["all-r8"])}, None, "too many fields"),
    # A few parts the form does not take are named, not counted (as "too many files").
    "a checkpoint folder's other files": (lambda a: {**_fields(), "files": {
        **files_of(a["all-r8"]), "README.md": ("README.md", b"# card"),
        "training_args.bin": ("training_args.bin", b"x"), "optimizer.pt": ("optimizer.pt", b"x")}},
        "README.md", "unexpected file part 'readme.md'"),
    "other text fields": (lambda a: {**_fields(c="1", d="2", e="3"), "files": files_of(a["all-r8"])},
                          "c", "unexpected form field 'c'"),
    # What requests.post(data=...) sends: once refused as lacking the file.
    "a file sent as a text field": (lambda a: {
        **_fields(**{"adapter_config.json": (a["all-r8"] / "adapter_config.json").read_text()}),
        "files": {"adapter_model.safetensors": files_of(a["all-r8"])["adapter_model.safetensors"]}},
        "adapter_config.json", "came as a text field; send it as a file"),
    # What curl -F name=@file sends: once refused as "too many files".
    "a text field sent as a file": (lambda a: {"data": {"base_model": DEMO_MODEL}, "files": {
        "name": ("name.txt", b"bot"), **files_of(a["all-r8"])}},
        "name", "the field 'name' came as a file; send it as text"),
    # Parts sent twice: which one was meant is a guess.
    "a file part twice": (lambda a: {**_fields(), "files": [
        ("adapter_config.json", files_of(a["all-r8"])["adapter_config.json"]),
        *files_of(a["all-r8"]).items()]}, "adapter_config.json", "more than once"),
    "name twice": (lambda a: {**_fields(name=["a", "b"]), "files": files_of(a["all-r8"])}, "name",
                   "'name' more than once"),
    "base_model twice": (lambda a: {**_fields(base_model=[DEMO_MODEL, DEMO_MODEL]),
                                    "files": files_of(a["all-r8"])}, "base_model", "more than once"),
    "archive twice": (lambda a: {**_fields(), "files": [("file", ("a.tar.gz", b"1")),
                                                        ("file", ("b.tar.gz", b"2"))]}, "file",
                      "'file' more than once"),
}


@pytest.mark.parametrize("case", list(FORMS))
def test_forms_that_cannot_be_read_are_invalid_uploads(server, tenant, adapters, case):
    name, key = tenant
    build, param, words = FORMS[case]
    before = _snapshot(server, name)
    arguments = build(adapters)
    headers = {**auth(key), **arguments.pop("headers", {})}
    refused = httpx.post(server.url + "/v1/adapters", headers=headers, timeout=60, **arguments)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_upload", param), error
    assert words in error["message"].lower() and "multipart/form-data with" in error["message"]
    assert _snapshot(server, name) == before


def test_the_multipart_media_type_is_case_insensitive(server, tenant, adapters):
    _, key = tenant
    request = httpx.Request("POST", server.url + "/v1/adapters", headers=auth(key),
                            data={"name": "cased", "base_model": DEMO_MODEL},
                            files=files_of(adapters["attn-r4"]))
    headers = dict(request.headers)
    headers["content-type"] = headers["content-type"].replace("multipart/form-data",
                                                              "Multipart/Form-Data")
    stored = httpx.post(request.url, content=request.read(), headers=headers, timeout=60)
    assert stored.status_code == 201, stored.text
    assert greedy_ids(server, key, "cased") == adapters["expected"]["attn-r4"]


@pytest.fixture(scope="module")
def plain_engine(demo_model_dir):
    """An engine over the demo model without adapter slots (--max-loras 0)."""
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient

    engine = LocalEngineClient.load(EngineConfig(model=str(demo_model_dir), num_kv_blocks=16),
                                    show_progress=False)
    yield engine
    engine.close()


def test_an_engine_without_lora_refuses_uploads(plain_engine, tmp_path):
    with gateway_server(plain_engine, tmp_path) as plain:
        key = plain.new_tenant("plain")
        refused = upload(plain, key, "a", {
            "adapter_config.json": ("adapter_config.json", b"{}"),
            "adapter_model.safetensors": ("adapter_model.safetensors", b"")})
        error = refused.json()["error"]
        assert refused.status_code == 400
        assert (error["code"], error["param"]) == ("adapters_not_served", "base_model")
        assert error["message"] == (
            f"{DEMO_MODEL!r} is served here without adapter slots (--max-loras 0), so it runs no "
            "adapters: the operator must restart the server with --max-loras above 0; you may "
            "upload adapters for no base model served now")


class _CountingEngine:
    """`engine`, counting the requests the gateway sends it."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.num_requests = 0

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, *args, **kwargs):
        self.num_requests += 1
        return self._engine.generate(*args, **kwargs)


@pytest.mark.parametrize("model", ["bot", "fast:bot"])
def test_a_call_whose_adapter_is_deleted_before_the_engine_reads_it_is_not_found(
        demo_engine, adapters, tmp_path, model):
    """A call admitted for an adapter the tenant deletes before the engine reads its files gets the
    404 a call sent after the delete gets (it once got a 500 that clients retried), and the
    engine is left with nothing of it, nor is its tenant's rpm (a refused call is not counted).
    Through a route, no other tier answers instead (one did, without the adapter, billed at its
    price), nor is rpm counted (it was, as for a call its client left)."""
    from routing.routes import parse_routes
    from tests.conftest import serve_gateway

    engine = HeldEngine(demo_engine)
    engines = {DEMO_MODEL: engine, "large": demo_engine}
    routes = parse_routes({"fast": {"tiers": [DEMO_MODEL, "large"], "measure": "min_prob",
                                    "threshold": 0.0}}, engines)
    with serve_gateway(engines, tmp_path, routes=routes) as server:
        key = server.new_tenant("deleting", rpm=3)
        assert upload(server, key, "bot", unique_files(adapters["all-r8"])).status_code == 201
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, server.url + "/v1/completions", headers=auth(key),
                               json={"model": model, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
            assert engine.arrived.wait(30)
            deleted = httpx.delete(server.url + "/v1/adapters/bot", headers=auth(key))
            engine.resume.set()
            reply = call.result()
        stats = server.engine_metrics()
        # The upload used one of its 3 requests a minute; the refused call none.
        for _ in range(2):
            base = httpx.post(server.url + "/v1/completions", headers=auth(key), timeout=60,
                              json={"model": DEMO_MODEL, "prompt": PROMPT, "max_tokens": 1})
            assert base.status_code == 200, base.text
    assert deleted.status_code == 200, deleted.text
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"] == {
        "message": "the adapter 'bot' was deleted while this call waited to run; GET /v1/models "
                   "lists the models you can use", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)


@pytest.mark.parametrize("restarted_on, still_listed, why_not", [
    ("narrow_engine", ["slim"], f"{DEMO_MODEL!r} is served here with --max-lora-rank "
                                f"{NARROW_MAX_LORA_RANK}, so it cannot run: the operator must restart "
                                "the server with --max-lora-rank 8 or more"),
    ("plain_engine", [], f"{DEMO_MODEL!r} is served here without adapter slots (--max-loras 0), so "
                         "it runs no adapters: the operator must restart the server with "
                         "--max-loras above 0"),
], ids=["lower-rank", "no-lora"])
def test_an_adapter_the_restarted_server_cannot_run_is_refused_before_admission(
        request, demo_engine, adapters, tmp_path, restarted_on, still_listed, why_not):
    """Restarted with a lower --max-lora-rank than an uploaded adapter's rank, or with --max-loras
    0, a server can never run the adapter: its calls get a 503 saying what the operator must do,
    without Retry-After, before admission (no rate limit used, no engine request, so no files
    read), and /v1/models leaves it out. An adapter within the limit still runs."""
    engine = _CountingEngine(request.getfixturevalue(restarted_on))
    with gateway_server(demo_engine, tmp_path) as before:
        key = before.new_tenant("restarted", rpm=2)
        # By the admin, whose uploads use none of the tenant's rpm.
        for name, files in (("wide", adapters["all-r8"]), ("slim", adapters["attn-r4"])):
            assert upload(before, before.admin_key, name, files_of(files),
                          path="/admin/tenants/restarted/adapters").status_code == 201
    with gateway_server(engine, tmp_path) as after:
        def complete(model: str) -> httpx.Response:
            return httpx.post(after.url + "/v1/completions", headers=auth(key), timeout=60,
                              json={"model": model, "prompt": PROMPT, "max_tokens": 2})

        refused = [complete("wide") for _ in range(2)]
        num_refused_requests = engine.num_requests
        listed = list(models_of(after, key))
        retrieved = httpx.get(after.url + "/v1/models/wide", headers=auth(key))
        # The tenant's rpm of 2, which the refused calls left unused; an adapter within the limit
        # runs where there is one.
        answered = [complete(DEMO_MODEL), complete(still_listed[0] if still_listed else DEMO_MODEL)]
        limited = complete(DEMO_MODEL)
        metrics = after.admin("GET", "/metrics").text
    for reply in refused:
        assert reply.status_code == 503 and "retry-after" not in reply.headers, reply.text
        assert reply.headers["x-should-retry"] == "false"  # only the operator mends it
        assert reply.json()["error"] == {
            "message": f"adapter 'wide' has rank 8, but {why_not}", "type": "server_error",
            "param": None, "code": "engine_unavailable"}
    assert num_refused_requests == 0
    assert listed == [DEMO_MODEL, *still_listed]
    assert retrieved.status_code == 404
    assert [reply.status_code for reply in answered] == [200, 200]
    assert (limited.status_code, engine.num_requests) == (429, 2)
    # Labelled with the base model of the adapter the calls named, which resolved (not "-").
    assert sample(metrics, "switchboard_requests_total", tenant="restarted", model=DEMO_MODEL,
                  status=503) == 2


def test_a_route_runs_the_tenant_adapter_on_its_base_tier(demo_engine, adapters, tmp_path):
    """`route:adapter`: the tier on the adapter's base model runs with it, the others without."""
    from gateway.app import create_app
    from routing.routes import parse_routes
    from tests.conftest import ADMIN_KEY, GatewayServer, run_server

    engines = {"small": demo_engine, "large": demo_engine, "medium": demo_engine}  # one engine
    routes = parse_routes({
        "keep": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": 0.0},
        "escalate": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": 1.0},
        "upper": {"tiers": ["medium", "large"], "threshold": 0.5},
    }, engines)
    app = create_app(engines, data_dir=tmp_path, admin_key=ADMIN_KEY, routes=routes)
    with run_server(app) as url:
        server = GatewayServer(url, ADMIN_KEY, app)
        key = server.new_tenant("routed")
        assert upload(server, key, "bot", files_of(adapters["all-r8"]), base="small").status_code == 201
        expected = adapters["expected"]
        assert greedy_ids(server, key, "keep:bot", "small") == expected["all-r8"]  # + adapter
        assert greedy_ids(server, key, "escalate:bot", "large") == expected["base"]  # without
        with pytest.raises(openai.NotFoundError):
            greedy_ids(server, key, "keep:someone-elses")
        # A route none of whose models is the adapter's base model: the 404 says so.
        elsewhere = httpx.post(url + "/v1/completions", headers=auth(key),
                               json={"model": "upper:bot", "prompt": PROMPT, "max_tokens": 2})
        # NOTE: a request is counted once its response is sent: the last one may come after.
        counts = (("keep", 200, 1), ("escalate", 200, 1), ("-", 404, 2))
        assert eventually(lambda: all(
            sample(server.admin("GET", "/metrics").text, "switchboard_requests_total",
                   tenant="routed", model=model, status=status) == count
            for model, status, count in counts))
        metrics = server.admin("GET", "/metrics").text
    assert elsewhere.status_code == 404, elsewhere.text
    assert elsewhere.json()["error"]["message"] == (
        "the model 'upper:bot' cannot be used: the adapter 'bot' is for the base model 'small', "
        "which is not one of the models of route 'upper' (medium, large); GET /v1/models lists "
        "the models you can use")
    # Counted under the route (the tokens under the tier that ran), never under the adapter.
    assert "bot" not in metrics


@pytest.fixture(scope="module")
def short_engine(demo_model_dir):
    """An engine over the demo model with adapter slots and a context of 128 tokens only."""
    from adapters import AdapterConfig
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient

    lora = AdapterConfig(max_lora_rank=DEMO_MAX_LORA_RANK, max_gpu_adapters=2, max_cpu_adapters=4)
    engine = LocalEngineClient.load(EngineConfig(model=str(demo_model_dir), num_kv_blocks=64,
                                                 max_model_len=128, lora=lora), show_progress=False)
    yield engine
    engine.close()


def test_a_tenant_allowed_only_a_route_uploads_adapters_for_its_models_and_runs_them_through_it(
        demo_engine, short_engine, adapters, tmp_path):
    """Its `route:adapter` calls were allowed, but its uploads for the route's models were
    refused as an "unknown base model", the admin's for it too."""
    from routing.routes import parse_routes
    from tests.conftest import ADMIN_KEY, serve_gateway

    engines = {"small": short_engine, "large": demo_engine, "medium": demo_engine}
    routes = parse_routes({"keep": {"tiers": ["small", "large"], "measure": "min_prob",
                                    "threshold": 0.0},
                           "other": {"tiers": ["small", "medium"], "threshold": 0.0}}, engines)
    with serve_gateway(engines, tmp_path, routes=routes) as server:
        key = server.new_tenant("route-only", allowed_models=["keep"])
        uploads = [upload(server, key, "bot", files_of(adapters["all-r8"]), base="small"),
                   upload(server, ADMIN_KEY, "admins", files_of(adapters["all-r8"]), base="large",
                          path="/admin/tenants/route-only/adapters"),
                   upload(server, key, "elsewhere", files_of(adapters["all-r8"]), base="medium"),
                   upload(server, key, "on-route", files_of(adapters["all-r8"]), base="keep"),
                   upload(server, key, "off-route", files_of(adapters["all-r8"]), base="other")]
        routed = greedy_ids(server, key, "keep:bot", "small")
        direct = httpx.post(server.url + "/v1/completions", headers=auth(key),
                            json={"model": "bot", "prompt": PROMPT, "max_tokens": 2})
        names = [a["id"] for a in httpx.get(server.url + "/v1/adapters", headers=auth(key)).json()["data"]]
        listed = httpx.get(server.url + "/v1/models", headers=auth(key)).json()["data"]
        card = httpx.get(server.url + "/v1/models/keep:bot", headers=auth(key))
    assert [u.status_code for u in uploads] == [201, 201, 403, 400, 400], [u.text for u in uploads]
    # Its /v1/models lists no base model to upload for: the refusal names them.
    assert uploads[3].json()["error"]["message"] == (
        "'keep' is a route, not a base model: upload the adapter for one of its models, and call "
        "it as keep:NAME; the base models you may upload adapters for are small, large")
    # Not "call it as other:NAME", which its policy refuses.
    assert uploads[4].json()["error"]["message"] == (
        "'other' is a route your tenant's policy does not allow; the base models you may upload "
        "adapters for are small, large")
    # Listed under the ids that reach them (they were left out), with the route's context: a call
    # "small" cannot hold is answered by "large" (keep:bot was listed with small's 128).
    assert [(m["id"], m.get("parent"), m["max_model_len"]) for m in listed] == [
        ("keep", None, demo_engine.max_model_len), ("keep:admins", "large", demo_engine.max_model_len),
        ("keep:bot", "small", demo_engine.max_model_len)]
    assert short_engine.max_model_len == 128 < demo_engine.max_model_len
    assert card.status_code == 200 and card.json()["parent"] == "small"
    assert uploads[2].json()["error"] == {
        "message": "your tenant's policy allows neither the base model 'medium' nor a route over it, "
                   "so it takes none of your adapters; GET /v1/models lists the models and routes "
                   "you can use", "type": "permission_error", "param": "base_model",
        "code": "model_not_allowed"}
    assert routed == adapters["expected"]["all-r8"]
    # Its policy names the route alone: the adapter runs through it, not by its own name, which
    # is refused naming the id that reaches it (a bare "policy does not allow").
    assert direct.status_code == 403 and direct.json()["error"]["code"] == "model_not_allowed"
    assert direct.json()["error"]["message"] == (
        "your tenant's policy does not allow the model 'bot'; your policy allows the adapter "
        "through a route: call it as 'keep:bot'")
    assert sorted(names) == ["admins", "bot"]


def test_a_tenant_allowed_only_the_route_named_auto_uploads_adapters_run_as_auto_colon_name(
        demo_engine, adapters, tmp_path):
    """A route named "auto", the server's default, is reached as `auto` only: a tenant allowed it
    alone had its uploads for the route's models refused, the admin's for it too (403)."""
    from routing.routes import parse_routes
    from tests.conftest import ADMIN_KEY, serve_gateway

    engines = {"small": demo_engine, "large": demo_engine}
    routes = parse_routes({"auto": {"tiers": ["small", "large"], "measure": "min_prob",
                                    "threshold": 0.0}}, engines)
    with serve_gateway(engines, tmp_path, routes=routes, default_route="auto") as server:
        key = server.new_tenant("auto-only", allowed_models=["auto"])
        uploads = [upload(server, key, "bot", files_of(adapters["all-r8"]), base="small"),
                   upload(server, ADMIN_KEY, "admins", files_of(adapters["all-r8"]), base="large",
                          path="/admin/tenants/auto-only/adapters")]
        routed = greedy_ids(server, key, "auto:bot", "small")
        listed = httpx.get(server.url + "/v1/models", headers=auth(key)).json()["data"]
        adapter_list = httpx.get(server.url + "/v1/adapters", headers=auth(key)).json()["data"]
    assert [u.status_code for u in uploads] == [201, 201], [u.text for u in uploads]
    # The adapter API says what reaches each: the bare name was a 403.
    assert [u.json()["model"] for u in uploads] == ["auto:bot", "auto:admins"]
    assert [(a["id"], a["model"]) for a in adapter_list] == [("admins", "auto:admins"),
                                                             ("bot", "auto:bot")]
    assert [(m["id"], m.get("parent")) for m in listed] == [
        ("auto", None), ("auto:admins", "large"), ("auto:bot", "small")]
    assert routed == adapters["expected"]["all-r8"]


def test_an_adapter_of_a_base_model_no_longer_served_is_not_found(demo_engine, adapters, tmp_path):
    """Restarted serving its model under another name, a gateway has records of adapters for the
    old name: 404, as /v1/models says (it once answered a 503 that clients retried)."""
    from tests.conftest import serve_gateway

    with serve_gateway({DEMO_MODEL: demo_engine}, tmp_path) as before:
        key = before.new_tenant("renamed")
        assert upload(before, key, "bot", files_of(adapters["all-r8"])).status_code == 201
    with serve_gateway({"llama": demo_engine}, tmp_path) as after:
        listed = httpx.get(after.url + "/v1/models", headers=auth(key)).json()["data"]
        reply = httpx.post(after.url + "/v1/completions", headers=auth(key),
                           json={"model": "bot", "prompt": PROMPT, "max_tokens": 2})
    assert [m["id"] for m in listed] == ["llama"]
    assert reply.status_code == 404, reply.text
    error = reply.json()["error"]
    assert error["code"] == "model_not_found" and f"base model '{DEMO_MODEL}'" in error["message"]


def test_an_adapter_the_model_served_under_its_base_name_now_cannot_take_is_refused_until_uploaded(
        demo_engine, adapters, tmp_path):
    """Restarted serving a model of other shapes under the adapter's base model's name, a gateway
    answers a call of the adapter with a 503 not to be retried, saying to upload it again (it once
    answered a 500 that clients retried, each try failing as the last); the model serves on."""
    from adapters import AdapterConfig
    from engine.config import EngineConfig
    from gateway.local_engine import LocalEngineClient
    from tests.conftest import serve_gateway
    from tests.helpers import make_hf_model, save_hf_model

    with serve_gateway({DEMO_MODEL: demo_engine}, tmp_path) as before:
        key = before.new_tenant("reshaped")
        assert upload(before, key, "bot", files_of(adapters["all-r8"])).status_code == 201
    folder = save_hf_model(make_hf_model(seed=3), tmp_path / "narrower")  # hidden size 64, not 256
    other = LocalEngineClient.load(EngineConfig(model=str(folder), num_kv_blocks=64, lora=AdapterConfig(
        max_lora_rank=DEMO_MAX_LORA_RANK, max_gpu_adapters=1, max_cpu_adapters=1)), show_progress=False)
    try:
        with serve_gateway({DEMO_MODEL: other}, tmp_path) as after:
            call = {"prompt": [1, 2, 3], "max_tokens": 2}
            refused = httpx.post(after.url + "/v1/completions", headers=auth(key),
                                 json={"model": "bot", **call})
            served = httpx.post(after.url + "/v1/completions", headers=auth(key),
                                json={"model": DEMO_MODEL, **call})
    finally:
        other.close()
    assert refused.status_code == 503, refused.text
    assert refused.headers["x-should-retry"] == "false" and "retry-after" not in refused.headers
    error = refused.json()["error"]
    assert error["code"] == "adapter_incompatible", error
    assert error["message"].startswith(f"the adapter does not fit the model served as '{DEMO_MODEL}' now")
    assert "upload it again" in error["message"]
    assert served.status_code == 200, served.text


def test_an_adapter_whose_name_a_model_or_route_takes_later_is_reached_as_base_colon_name(
        demo_engine, adapters, tmp_path, caplog):
    """Restarted with a served model and a route named as a tenant's adapters, a gateway runs
    those for the bare names (the operator's names come first), lists each id once, the adapters
    as `base:name`, which answer as the adapters did, and warns of each adapter at startup."""
    from routing.routes import parse_routes
    from tests.conftest import serve_gateway

    names = {"support": "all-r8", "fast": "attn-r4"}  # adapter name -> its files
    kept = {"kept": {"tiers": ["small", "large"], "measure": "min_prob", "threshold": 0.0}}
    with serve_gateway({"small": demo_engine, "large": demo_engine}, tmp_path,
                       routes=parse_routes(kept, {"small": demo_engine, "large": demo_engine})) as before:
        key = before.new_tenant("early")
        for name, files in names.items():
            assert upload(before, key, name, files_of(adapters[files]), base="small").status_code == 201
        answered = {name: greedy_ids(before, key, name) for name in names}
        # A tenant allowed the base model through a route only reaches its adapter as route:name.
        routed = before.new_tenant("routed", allowed_models=["kept"])
        assert upload(before, routed, "support", files_of(adapters["all-r8"]),
                      base="small").json()["model"] == "kept:support"
    assert answered == {name: adapters["expected"][files] for name, files in names.items()}

    engines = {"small": demo_engine, "support": demo_engine, "large": demo_engine}
    routes = parse_routes({"fast": {"tiers": ["small", "support"], "measure": "min_prob",
                                    "threshold": 0.0}, **kept}, engines)
    with caplog.at_level(logging.WARNING, logger="gateway.shadowing"):
        with serve_gateway(engines, tmp_path, routes=routes) as after:
            cards = httpx.get(after.url + "/v1/models", headers=auth(key)).json()["data"]
            retrieved = httpx.get(after.url + "/v1/models/small:fast", headers=auth(key))
            as_adapters = {name: greedy_ids(after, key, f"small:{name}") for name in names}
            by_name = {name: httpx.post(after.url + "/v1/completions", headers=auth(key), json={
                "model": name, "prompt": PROMPT, "max_tokens": 2}) for name in names}
            base = greedy_ids(after, key, "support")
            shown = httpx.get(after.url + "/v1/adapters", headers=auth(key)).json()["data"]
            one = httpx.get(after.url + "/v1/adapters/support", headers=auth(key)).json()
    # The adapter API says which `model` reaches each: a client that sent its bare name ran
    # the operator's model instead, with no error.
    assert [(a["id"], a["model"]) for a in shown] == [("fast", "small:fast"),
                                                      ("support", "small:support")]
    assert (one["id"], one["model"]) == ("support", "small:support")
    assert [(c["id"], c.get("parent")) for c in cards] == [
        ("small", None), ("support", None), ("large", None), ("fast", None), ("kept", None),
        ("small:fast", "small"), ("small:support", "small")]
    assert retrieved.status_code == 200 and retrieved.json() == cards[5]
    assert as_adapters == answered
    # The bare names run the operator's model and route, as the headers say.
    assert by_name["support"].headers["x-switchboard-model"] == "support"
    assert by_name["fast"].headers["x-switchboard-route"] == "fast"
    assert base == adapters["expected"]["base"]
    warnings = sorted(r.getMessage() for r in caplog.records if r.name == "gateway.shadowing")
    assert len(warnings) == 3, warnings
    assert warnings[0].startswith("adapter 'fast' of tenant 'early' (base model 'small') has the "
                                  "name of the route 'fast'") and "as 'small:fast'" in warnings[0]
    assert warnings[1].startswith("adapter 'support' of tenant 'early' (base model 'small') has the "
                                  "name of the served model 'support'")
    assert "as 'small:support'" in warnings[1]
    # It named small:support, which answers 403 to that tenant.
    assert warnings[2].startswith("adapter 'support' of tenant 'routed'") and \
        "reaches the adapter as 'kept:support'" in warnings[2]


def test_a_gateway_started_on_another_store_leaves_the_adapter_folder_s_files_alone(
        demo_engine, adapters, tmp_path, caplog):
    """A SQLite store's adapter folder holds the only copy of its files: a gateway started on
    another store (a fresh one, its --data-dir mistyped) deleted them all as deleted adapters'
    files, and every call of those adapters on the right store then got 503 "upload it again"."""
    from store.blobs import BlobStore
    from tests.conftest import ADMIN_KEY

    folder = tmp_path / "adapters"
    with gateway_server(demo_engine, tmp_path / "right", adapter_dir=folder) as right:
        key = right.new_tenant("keeper")
        assert upload(right, key, "bot", files_of(adapters["all-r8"])).status_code == 201
        before = greedy_ids(right, key, "bot")
    with caplog.at_level(logging.WARNING, logger="store.blobs"):
        with gateway_server(demo_engine, tmp_path / "wrong", adapter_dir=folder) as wrong:
            # Its tenants' adapters of the same files, deleted, deleted those files too: one
            # deleted by its tenant, one with its tenant.
            keys = [wrong.new_tenant(tenant) for tenant in ("deletes-adapter", "deleted")]
            for other_key in keys:
                assert upload(wrong, other_key, "mine", files_of(adapters["all-r8"])).status_code == 201
            assert httpx.delete(wrong.url + "/v1/adapters/mine", headers=auth(keys[0])).status_code == 200
            assert httpx.delete(wrong.url + "/admin/tenants/deleted",
                                headers=auth(ADMIN_KEY)).status_code == 200
    assert [r.getMessage() for r in caplog.records if "keeps the files of another store" in
            r.getMessage()], caplog.text
    stray, _ = BlobStore(folder).put(adapters["attn-r4"])  # files no record of the right store names
    with gateway_server(demo_engine, tmp_path / "right", adapter_dir=folder) as again:
        assert greedy_ids(again, key, "bot") == before
        assert BlobStore(folder).path(stray) is None  # its own store still drops what it does not name
    assert (folder / OWNER_FILE).is_file()
