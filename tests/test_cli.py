"""The `switchboard` command: help, settings from options/env/TOML, and a real `serve` run."""

import asyncio
import json
import contextlib
import logging
import os
import re
import shutil
import signal
import socket
import sqlite3
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from starlette.applications import Starlette
from starlette.routing import Mount

from gateway.cli import STORE_WAIT_S, main
from gateway.config import ServeConfig, load_serve_config, parse_size
from store import Usage, open_store
from tests.conftest import ADMIN_KEY, DEMO_MODEL, GatewayServer, run_server
from tests.helpers import fill_volume, small_volume
from tests.processes import free_port
from tests.redis_server import start_redis_server, stop_redis_server
from tests.test_gateway_routing import eventually

SWITCHBOARD = [sys.executable, "-m", "gateway.cli"]  # what the `switchboard` script runs
SCRIPT = [shutil.which("switchboard")] if shutil.which("switchboard") else SWITCHBOARD


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["worker", "--help"],
                                  ["router", "train", "--help"]])
def test_help_exits_zero(argv):
    result = subprocess.run(SCRIPT + argv, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "usage: switchboard" in result.stdout
    if "serve" in argv:
        assert all(option in result.stdout for option in (
            "--model NAME=PATH", "--host", "--port", "--data-dir", "--store", "--admin-key",
            "--device", "--dtype", "--config", "--max-num-seqs", "--max-num-batched-tokens",
            "--kv-cache-memory", "--max-model-len", "--max-loras", "--max-cpu-loras",
            "--max-lora-rank", "--adapter-dir", "--max-upload-size", "--redis",
            "--shutdown-timeout", "SWITCHBOARD_HOME"))
    if "worker" in argv:
        assert all(option in result.stdout for option in (
            "--redis URL", "--model NAME=PATH", "--advertise-url", "--heartbeat", "--device",
            "--max-loras", "--kv-cache-memory", "--shutdown-timeout"))


def test_a_worker_serves_exactly_one_local_model(tmp_path, capsys):
    two = ["worker", "--redis", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path),
           "--model", f"a={tmp_path}", "--model", f"b={tmp_path}"]
    assert main(two) == 2
    assert "exactly one local model" in capsys.readouterr().err
    anywhere = ["worker", "--redis", "redis://127.0.0.1:1/0", "--model", f"a={tmp_path}",
                "--host", "0.0.0.0"]
    assert main(anywhere) == 2
    assert "--advertise-url" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_servers_raise_their_open_files_limit_as_far_as_its_hard_limit_allows(command, tmp_path):
    """Each request to a worker or an upstream holds a connection: at a soft limit of 1024 (as
    under systemd or Docker), a call with 1100 choices failed as if its worker were down."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"this machine's hard limit on open files is {hard}")
    expected = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    result = subprocess.run(
        SWITCHBOARD + [command, "--data-dir", str(not_a_folder)], capture_output=True, text=True,
        timeout=60, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    assert result.returncode == 2  # then refused: no Redis, or a --data-dir that is a file
    assert f"raised the open-files limit from 256 to {expected}" in result.stderr


def test_a_worker_takes_its_redis_from_its_config_file_and_needs_one(tmp_path, capsys):
    """argparse required --redis on the command line, before the file was read."""
    config = tmp_path / "worker.toml"
    config.write_text(f'redis = "redis://127.0.0.1:1/0"\ndata_dir = "{tmp_path / "data"}"\n')
    assert main(["worker", "--config", str(config)]) == 2
    assert "127.0.0.1:1" in capsys.readouterr().err  # the file's Redis, tried (nothing listens)
    config.write_text(f'data_dir = "{tmp_path / "data"}"\n')
    assert main(["worker", "--config", str(config)]) == 2
    assert "switchboard worker: give the Redis the gateways use: --redis URL" in capsys.readouterr().err


def test_a_command_is_required():
    with pytest.raises(SystemExit) as raised:
        main([])
    assert raised.value.code == 2


def test_command_line_beats_environment_beats_config_file(tmp_path):
    config = tmp_path / "switchboard.toml"
    config.write_text('port = 9000\nhost = "0.0.0.0"\nmax-num-seqs = 8\nadmin_key = "from-file"\n'
                      'model = ["a=/models/a", "/models/b"]\nkv_cache_memory = "2GiB"\n'
                      'max_loras = 4\nmax_upload_size = "64MiB"\n')
    environ = {"SWITCHBOARD_ADMIN_KEY": "from-env", "SWITCHBOARD_HOME": "/srv/sb"}
    loaded = load_serve_config({"port": 9100}, config, environ)
    assert (loaded.port, loaded.host, loaded.max_num_seqs) == (9100, "0.0.0.0", 8)
    assert (loaded.admin_key, loaded.data_dir) == ("from-env", Path("/srv/sb"))
    assert loaded.model_paths() == {"a": Path("/models/a"), "b": Path("/models/b")}
    assert loaded.engine_options() == {
        "device": "cpu", "dtype": "float32", "max_num_seqs": 8, "kv_cache_memory_bytes": 2 << 30,
        "lora": {"max_gpu_adapters": 4, "max_cpu_adapters": 64, "max_lora_rank": 64}}
    assert loaded.max_upload_size == 64 << 20
    assert "lora" not in load_serve_config({"max_loras": 0}, None, {}).engine_options()
    defaults = load_serve_config({}, None, {})
    assert (defaults.host, defaults.port, defaults.data_dir) == ("127.0.0.1", 8000, Path("data"))
    # "~" as a shell would expand it: no shell reads a config file or a service's environment.
    config.write_text('data_dir = "~/sb"\nadapter_dir = "~/adapters"\n')
    at_home = load_serve_config({}, config, {})
    assert (at_home.data_dir, at_home.adapter_dir) == (Path.home() / "sb", Path.home() / "adapters")
    assert load_serve_config({}, None, {"SWITCHBOARD_HOME": "~/x"}).data_dir == Path.home() / "x"
    # One setting spelt two ways: one of them was dropped without a word.
    for twice in ('max-num-seqs = 8\nmax_num_seqs = 16\n', 'heartbeat = 2\nheartbeat_s = 3\n'):
        config.write_text(twice)
        with pytest.raises(ValueError, match="sets one setting twice, as .* and .*: keep one"):
            load_serve_config({}, config, {}, command="worker")
    assert defaults.model_paths() == {} and defaults.store is None and defaults.admin_key is None


@pytest.mark.parametrize("home", ["~/sb", "/srv/sb"])
def test_the_engine_keeps_the_demo_model_in_switchboard_home_as_serve_reads_it(home):
    from engine.demo import DEMO_NAME, default_demo_dir

    # LLM() kept a second copy in a folder named "~" under the current one.
    served = load_serve_config({}, None, {"SWITCHBOARD_HOME": home}).data_dir / DEMO_NAME
    assert default_demo_dir({"SWITCHBOARD_HOME": home}) == served
    assert "~" not in str(served)
    # Empty, as unset (it wrote the demo model into the current folder).
    unset = Path.home() / ".cache" / "switchboard" / DEMO_NAME
    assert default_demo_dir({"SWITCHBOARD_HOME": ""}) == default_demo_dir({}) == unset


@pytest.mark.parametrize("text, size", [("1024", 1024), ("512MiB", 512 << 20), ("4G", 4 << 30),
                                        ("3 KiB", 3 << 10), ("4GB", 4 * 10**9), ("2 kb", 2000)])
def test_parse_size(text, size):
    assert parse_size(text) == size


def test_a_size_that_cannot_be_read_says_how_to_write_one(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--kv-cache-memory", "lots"])
    assert exited.value.code == 2
    assert "cannot read 'lots' as a size: use bytes or e.g. 512MiB" in capsys.readouterr().err


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_router_train_refuses_a_seed_torch_cannot_take(seed, tmp_path, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["router", "train", str(tmp_path / "data.jsonl"), "--out", str(tmp_path), "--seed", seed])
    assert exited.value.code == 2
    assert f"argument --seed: must be from 0 to {2**63 - 1}, got {seed}" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    (dict(model=["a=/x", "a=/y"]), "given twice"),
    (dict(model=["=/x"]), "NAME=PATH"),
    (dict(port=70000), "port"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    # Each once registered a worker every call to which failed (503), with no error at startup.
    (dict(advertise_url="10.0.0.7:9000"), "advertise_url must be an http"),
    # A name with ':' hid the tenant's adapter: "demo:x" ran the model so named, without x.
    (dict(model=["demo:x=/m"]), "invalid model name 'demo:x'"),
    (dict(models={"auto": {"upstream": "https://h/v1"}}), "invalid model name 'auto'"),
    (dict(model=["my model=/m"]), "without spaces or ':'"),
    # Each once a traceback at startup; the last one loaded every model before it failed.
    (dict(store="redis://localhost:99999/0"), "Redis URL 'redis://localhost:99999/0': Port out"),
    (dict(store="redis://:pw@h:6379/abc"), r"'redis://:\*\*\*@h:6379/abc': the database must be"),
    (dict(store="redis://[::1/0"), "cannot use the Redis URL: Invalid IPv6 URL"),
    # The password's text first found in the user's name (or scheme): the password was shown.
    (dict(store="redis://admin:admin@h:6379/x"), r"'redis://admin:\*\*\*@h:6379/x': the database"),
    (dict(store="redis://u:redis@h:6379/x"), r"'redis://u:\*\*\*@h:6379/x': the database"),
    # A traceback (a TypeError as it first connected), exit 1.
    (dict(store="redis://:pw@h:6379/0?sockt_timeout=5"),
     r"'redis://:\*\*\*@h:6379/0\?sockt_timeout=5': redis-py knows no query argument 'sockt_timeout'"),
    (dict(redis="unix:///run/redis.sock?foo=1"), "redis-py knows no query argument 'foo'"),
    (dict(redis="unix://"), "unix:// needs the socket's path"),
    (dict(redis="http://localhost:6379/0"), "it is not a Redis URL"),
    (dict(heartbeat_s=float("inf")), r"heartbeat must be in \[0.1, 3600.0\] seconds, got inf"),
    # Its record lapsed in 0 ms (Redis refused that: exit 3 with a traceback) or a few.
    (dict(heartbeat_s=0.0001), r"heartbeat must be in \[0.1, 3600.0\] seconds, got 0.0001"),
    (dict(advertise_url="http://:9000"), "advertise_url must be an http"),
    # Each registered a worker every call placed on which was a 500.
    (dict(advertise_url="http://10.0.0.7:90000"), "advertise_url must be an http"),
    (dict(advertise_url="http://10.0.0.7:90o0"), "advertise_url must be an http"),
    (dict(advertise_url="http://10.0.0.7:0"), "advertise_url must be an http"),
    (dict(advertise_url="http://10.0.0 .7:9000"), "advertise_url must be an http"),
    (dict(advertise_url="http://10.0.0.7:9000/?x=1"), "advertise_url must be an http"),
])
def test_invalid_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServeConfig(**kwargs)


@pytest.mark.parametrize("kwargs, shown", [
    # A password holding "/", "?" or "#" ends the host as parsed: the rest of it was shown, in
    # the path, in redis-py's own message (the port it could not read: "Pa55"), or all of it
    # (a scheme not known).
    (dict(store="redis://:Ab3/xSECRET@h:6379/0"), "'redis://:***@h:6379/0': its password holds"),
    (dict(redis="redis://default:Pa55#wSECRET@h:6379/0"), "'redis://default:***@h:6379/0'"),
    (dict(store="redis://u:123?SECRET@h:6379/0"), "'redis://u:***@h:6379/0'"),
    (dict(store="Redis://:SECRET@h:6379/0"), "unknown store URL 'Redis://:***@h:6379/0'"),
    # redis-py takes the password as a query argument too, its name percent-encoded or not.
    (dict(store="redis://h:6379/0?password=SECRET&db=x"), "'redis://h:6379/0?password=***&db=x'"),
    (dict(redis="redis://h:6379/0?pass%77ord=SECRET&db=x"), "'redis://h:6379/0?pass%77ord=***&db=x'"),
])
def test_a_redis_url_refused_never_shows_its_password(kwargs, shown):
    with pytest.raises(ValueError) as refused:
        ServeConfig(**kwargs)
    assert shown in str(refused.value)
    assert "SECRET" not in str(refused.value) and "Pa55" not in str(refused.value)


def test_a_redis_password_with_reserved_characters_works_percent_encoded():
    # What the refusal of such a password in a URL says to do works: redis-py decodes it.
    import redis

    proc, url = start_redis_server()
    try:
        password = "Ab3/x?y#z"
        redis.Redis.from_url(url).config_set("requirepass", password)
        encoded = url.replace("redis://", "redis://:Ab3%2Fx%3Fy%23z@")
        assert ServeConfig(store=encoded).store == encoded
        with redis.Redis.from_url(encoded) as client:
            assert client.ping()
    finally:
        stop_redis_server(proc)


def test_a_worker_s_advertised_url_loses_its_trailing_slash():
    # Gateways append their paths: "http://w:9000/" + "/internal/generate" reached nothing.
    assert ServeConfig(advertise_url="http://w:9000/").advertise_url == "http://w:9000"
    assert ServeConfig(advertise_url="https://lb/w1/").advertise_url == "https://lb/w1"


@pytest.mark.parametrize("text, message", [
    # Each once a traceback (AttributeError, TypeError) or a message that named no setting.
    ("kv_cache_memory = 1.5", "kv_cache_memory: cannot read 1.5 as a size"),
    ('max_upload_size = "1.5GiB"', "max_upload_size: cannot read '1.5GiB' as a size"),
    ('[models.a]\npath = "/m"\nkv_cache_memory = "2 gigs"',
     "[models.a] kv_cache_memory: cannot read '2 gigs' as a size"),
    ("model = [5]", "Expected `str`, got `int` - at `model[0]`"),
    ("model = 5", "Expected `array`, got `int` - at `model`"),
    ("models = [1]", "Expected `object`, got `array` - at `models`"),
    ("host = 5", "Expected `str`, got `int` - at `host`"),
    ("adapter_dir = 5", "Expected a folder path (a string), got int - at `adapter_dir`"),
    ('max_num_seqs = "32"', "Expected `int | null`, got `str` - at `max_num_seqs`"),
    ("max_model_len = 100.7", "got `float` - at `max_model_len`"),
    ('log_level = "verbose"', "log_level must be one of debug, info"),
    ('store = "postgres://db/x"', "unknown store URL 'postgres://db/x'"),
    ('admin_key = "two words"', "admin_key must be one word"),
    ("shutdown_timeout = -1", "shutdown_timeout must be >= 0 seconds, got -1"),
    ('default_route = "auto"', "default_route 'auto' is not a declared route: declare [routes.auto]"),
])
def test_config_values_of_the_wrong_type_exit_2_naming_the_setting(tmp_path, capsys, text, message):
    config = tmp_path / "bad.toml"
    config.write_text(text + "\n")
    assert main(["serve", "--config", str(config), "--data-dir", str(tmp_path / "data")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "data").exists()  # refused before anything loads


def test_keys_from_secret_files_lose_their_newline_and_a_worker_s_port_comes_from_its_file(tmp_path):
    keys = load_serve_config({}, None, {"SWITCHBOARD_ADMIN_KEY": "sb-admin-secret\n",
                                        "SWITCHBOARD_METRICS_KEY": " metrics-secret\r\n"})
    assert (keys.admin_key, keys.metrics_key) == ("sb-admin-secret", "metrics-secret")
    config = tmp_path / "worker.toml"
    config.write_text("port = 56001\n")
    worker_defaults = {"port": 9000}
    assert load_serve_config({}, config, {}, defaults=worker_defaults).port == 56001
    assert load_serve_config({}, None, {}, defaults=worker_defaults).port == 9000
    assert load_serve_config({"port": 1234}, config, {}, defaults=worker_defaults).port == 1234


@pytest.mark.parametrize("name", ["admin_key", "metrics_key"])
@pytest.mark.parametrize("key", ["pässwörd-admin", "sb-bell\x07"])
def test_keys_no_http_header_can_carry_exit_2_without_echoing_them(name, key, tmp_path, capsys):
    option, variable = "--" + name.replace("_", "-"), "SWITCHBOARD_" + name.upper()
    data = ["--data-dir", str(tmp_path / "data"), "--model", f"gone={tmp_path / 'nowhere'}"]
    assert main(["serve", option, key, *data]) == 2
    err = capsys.readouterr().err
    assert f"{name} must be printable ASCII only" in err and key not in err
    assert not (tmp_path / "data").exists()  # refused before anything loads
    with pytest.raises(ValueError, match=f"{name} must be printable ASCII only"):
        load_serve_config({}, None, {variable: key})


def test_unknown_config_keys_exit_2_with_the_reason(tmp_path, capsys, monkeypatch):
    config = tmp_path / "bad.toml"
    config.write_text("prot = 1\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "unknown keys" in capsys.readouterr().err
    # "~" after "=", which a shell leaves as is: the file was looked for in a folder named "~".
    monkeypatch.setenv("HOME", str(tmp_path))
    for command in ("serve", "worker"):
        assert main([command, "--config=~/bad.toml"]) == 2
        assert "unknown keys" in capsys.readouterr().err


def test_serve_prints_a_new_admin_key_once_and_serves(demo_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "SWITCHBOARD_HOME": str(tmp_path / "home")}
    env.pop("SWITCHBOARD_ADMIN_KEY", None)
    command = SWITCHBOARD + ["serve", "--port", str(port), "--model",
                             f"{DEMO_MODEL}={demo_model_dir}", "--kv-cache-memory", "16MiB"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        admin_key = _read_admin_key(process)
        _wait_for_health(url, process)
        auth = {"Authorization": f"Bearer {admin_key}"}
        assert httpx.post(url + "/admin/tenants", json={"name": "cli"}, headers=auth).status_code == 201
        key = httpx.post(url + "/admin/tenants/cli/keys", headers=auth).json()["key"]
        completion = httpx.post(url + "/v1/completions", timeout=30, json={
            "model": DEMO_MODEL, "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
            headers={"Authorization": f"Bearer {key}"})
        assert completion.json()["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert admin_key not in stdout  # printed once, before this rest of the output
    assert "POST /v1/completions 200 tenant=cli model=switchboard-demo" in stderr
    assert (tmp_path / "home" / "switchboard.db").is_file()


def _read_admin_key(process: subprocess.Popen) -> str:
    for line in process.stdout:
        if line.strip().startswith("sb-admin-"):
            return line.strip()
    raise AssertionError(f"no admin key printed; stderr: {process.stderr.read()}")


def _wait_for_health(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120  # as tests/processes.py: a loaded machine takes ~40 s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:  # not listening yet, or too busy to answer in time
            time.sleep(0.1)
    raise AssertionError("the server did not become healthy")


def test_model_tables_declare_paths_and_prices(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('model = ["a=/models/a"]\n'
                      '[models.big]\npath = "/models/big"\nprice_input = 1.5\nprice_output = 6\n')
    loaded = load_serve_config({}, config, {})
    assert loaded.model_paths() == {"a": Path("/models/a"), "big": Path("/models/big")}
    big = loaded.model_entries()[1]
    assert (big.name, big.price_input, big.price_output) == ("big", 1.5, 6.0)
    config.write_text('[models.remote]\nprice_input = 2\ntier = 1\n')  # served by workers
    remote = load_serve_config({"redis": "redis://127.0.0.1:1/0"}, config, {}).model_entries()[0]
    assert (remote.name, remote.path, remote.upstream, remote.price_input) == ("remote", None, None, 2.0)
    for bad, words in (('[models.x]\nprice_input = 1\n', "only a gateway with engine workers"),
                       ('[models.x]\nkv_cache_memory = "1GiB"\n', "unknown keys"),
                       ('[models.x]\npath = "/m"\nprice_output = -1\n', "must be a finite number >= 0"),
                       ('[models.x]\npath = "/m"\ncolour = "red"\n', "unknown keys"),
                       ('[models.x]\npath = 5\n', r"\[models.x\] path must be the model's folder"),
                       ('model = ["x=/m"]\n[models.x]\npath = "/n"\n', "given twice")):
        config.write_text(bad)
        with pytest.raises(ValueError, match=words):
            load_serve_config({}, config, {})


def test_model_tables_declare_upstreams_without_their_keys(tmp_path):
    config = tmp_path / "models.toml"
    config.write_text('[models.small]\npath = "/models/small"\ntier = 0\n'
                      '[models.big]\nupstream = "https://api.example.com/v1"\n'
                      'api_key_env = "BIG_KEY"\nupstream_model = "big-v2"\ntimeout_s = 5\n'
                      'max_model_len = 4096\nprice_input = 1\nprice_output = 4\ntier = 1\n'
                      '[models.open]\nupstream = "http://10.0.0.2:8000/v1"\n')
    loaded = load_serve_config({}, config, {})
    assert loaded.model_paths() == {"small": Path("/models/small")}  # local models only
    big, open_ = loaded.upstreams()["big"], loaded.upstreams()["open"]
    assert (big.url, big.model, big.api_key_env, big.timeout_s, big.max_model_len) == \
        ("https://api.example.com/v1", "big-v2", "BIG_KEY", 5.0, 4096)
    assert (open_.model, open_.api_key_env, open_.timeout_s) == ("open", None, 30.0)
    assert [(e.name, e.tier, e.price_output) for e in loaded.model_entries()] == \
        [("small", 0, 0.0), ("big", 1, 4.0), ("open", 0, 0.0)]
    assert big.api_key({"BIG_KEY": "sk-secret"}) == "sk-secret" and open_.api_key({}) is None
    with pytest.raises(ValueError, match="BIG_KEY is not set"):
        big.api_key({})


@pytest.mark.parametrize("table, words", [
    ('path = "/m"\nupstream = "http://h/v1"\n', "not both"),
    ('upstream = "ftp://h/v1"\n', "http\\(s\\) base URL"),
    # Each started, and every call to the model was a 502 saying to try again later.
    ('upstream = "http://127.0.0.1:99999/v1"\n', "http\\(s\\) base URL"),
    ('upstream = "http://127.0.0.1:8o00/v1"\n', "http\\(s\\) base URL"),
    ('upstream = "https://user:sk-secret@h/v1"\n', "must not hold credentials"),
    ('upstream = "https://h/v1"\napi_key = "sk-secret"\n', "must not hold the API key"),
    ('upstream = "https://h/v1"\napi_key_env = "sk-secret"\n', "must name an environment"),
    ('upstream = "https://h/v1"\ntimeout_s = 0\n', "timeout_s must be a finite number > 0"),
    ('upstream = "https://h/v1"\nmax_model_len = 0\n', "max_model_len must be an integer in \\[1, "),
    # A route over two such contexts held more tokens than the store's integers: a 500 per chat.
    ('upstream = "https://h/v1"\nmax_model_len = 9223372036854775807\n', "max_model_len must be"),
    # A price of inf billed inf (stored as null) and refused every call of a spend-budgeted tenant.
    ('upstream = "https://h/v1"\nprice_input = inf\n', "price_input must be a finite number"),
    # 1e308 per million tokens is finite, but a call's cost of it overflowed to inf.
    ('upstream = "https://h/v1"\nprice_output = 1e308\n', "price_output must be a finite number >= 0 "
                                                          "and <= 1e\\+09"),
    ('upstream = "https://h/v1"\nupstream_model = ""\n', "upstream_model"),
    ('path = "/m"\ntier = -1\n', "tier must be an integer >= 0"),
    ('path = "/m"\ntier = 1.5\n', "tier must be an integer"),
    ('path = "/m"\ntimeout_s = 5\n', "unknown keys .*: timeout_s"),
])
def test_invalid_model_tables_are_refused_without_echoing_secrets(tmp_path, table, words):
    config = tmp_path / "models.toml"
    config.write_text("[models.x]\n" + table)
    with pytest.raises(ValueError, match=words) as raised:
        load_serve_config({}, config, {})
    assert "sk-secret" not in str(raised.value)


def test_serve_refuses_an_upstream_whose_key_variable_is_unset(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SB_TEST_UNSET_KEY", raising=False)
    config = tmp_path / "upstream.toml"
    config.write_text('[models.big]\nupstream = "http://127.0.0.1:9/v1"\n'
                      'api_key_env = "SB_TEST_UNSET_KEY"\n')
    assert main(["serve", "--config", str(config), "--data-dir", str(tmp_path / "data")]) == 2
    assert "SB_TEST_UNSET_KEY is not set" in capsys.readouterr().err


def test_each_local_model_can_have_its_own_kv_cache_budget(tmp_path):
    config = tmp_path / "budgets.toml"
    config.write_text('kv_cache_memory = "1GiB"\n'
                      '[models.small]\npath = "/m/small"\nkv_cache_memory = "256MiB"\n'
                      '[models.large]\npath = "/m/large"\n')
    loaded = load_serve_config({}, config, {})
    assert loaded.engine_options_of("small")["kv_cache_memory_bytes"] == 256 << 20
    assert loaded.engine_options_of("large")["kv_cache_memory_bytes"] == 1 << 30
    config.write_text('[models.up]\nupstream = "http://h/v1"\nkv_cache_memory = "1GiB"\n')
    with pytest.raises(ValueError, match="unknown keys"):
        load_serve_config({}, config, {})


def test_a_model_that_cannot_be_served_exits_2_saying_why(demo_model_dir, tmp_path, capsys):
    data = ["--data-dir", str(tmp_path / "data"), "--port", "0"]  # the port is taken first
    assert main(["serve", "--model", f"gone={tmp_path / 'nowhere'}", *data]) == 2
    assert "cannot serve 'gone' from" in capsys.readouterr().err  # once a traceback
    too_long = ["serve", "--model", f"demo={demo_model_dir}", "--max-model-len", "100000", *data]
    assert main(too_long) == 2
    assert "max_model_len 100000 is more than the 2048 tokens this model was trained for" in \
        capsys.readouterr().err
    # 4 MiB of KV cache is 64 blocks of 16 tokens of the demo model: 1024 tokens
    kv_too_small = ["serve", "--model", f"demo={demo_model_dir}", "--max-model-len", "2048",
                    "--kv-cache-memory", "4MiB", *data]
    assert main(kv_too_small) == 2
    assert "max_model_len 2048 is more than the 1024 tokens the KV cache holds" in capsys.readouterr().err
    # Once a MemoryError traceback, from allocating the bookkeeping of 10^14 blocks.
    kv_too_large = ["serve", "--model", f"demo={demo_model_dir}", "--kv-cache-memory", "1000T", *data]
    assert main(kv_too_large) == 2
    assert "a KV budget of 1099511627776000 bytes is more than the cpu memory" in capsys.readouterr().err
    # Once a RuntimeError traceback from torch's allocator, after the model had loaded.
    slots_too_large = ["serve", "--model", f"demo={demo_model_dir}", "--max-loras", "1000000", *data]
    assert main(slots_too_large) == 2
    assert "device slots for 1000000 adapters of rank up to 64 take" in capsys.readouterr().err
    if not torch.cuda.is_available():  # once an AssertionError from deep in torch
        assert main(["serve", "--model", f"demo={demo_model_dir}", "--device", "cuda", *data]) == 2
        assert "torch sees no CUDA device" in capsys.readouterr().err


# A gateway whose store is elsewhere checked only its store: an unreachable --redis was a
# traceback (exit 3) after its admin key was made and printed, and its models loaded.
_REDIS_USERS = {"serve": ["serve"], "worker": ["worker"],
                "serve, store elsewhere": ["serve", "--store", "sqlite:///{tmp}/elsewhere.db"]}


@pytest.mark.parametrize("command", _REDIS_USERS)
def test_an_unreachable_redis_is_refused_before_any_model_loads(command, tmp_path, capsys):
    args = [a.format(tmp=tmp_path) for a in _REDIS_USERS[command]]
    assert main([*args, "--redis", "redis://127.0.0.1:1/0", "--data-dir", str(tmp_path)]) == 2
    assert "cannot reach the Redis store at 127.0.0.1:1/0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing loaded or written


def test_a_redis_database_the_server_refuses_is_named_without_a_query_password(tmp_path, capsys):
    import redis

    proc, url = start_redis_server()
    try:
        redis.Redis.from_url(url).config_set("requirepass", "SECRET")
        refused = url.rpartition("/")[0] + "/99?password=SECRET"
        assert main(["worker", "--redis", refused, "--data-dir", str(tmp_path)]) == 2
    finally:
        stop_redis_server(proc)
    shown = capsys.readouterr().err
    assert "refuses the connection: DB index is out of range" in shown
    assert "?password=***" in shown and "SECRET" not in shown


@pytest.mark.parametrize("command", _REDIS_USERS)
def test_a_redis_database_the_server_refuses_exits_2_before_any_model_loads(command, tmp_path, capsys):
    args = [a.format(tmp=tmp_path) for a in _REDIS_USERS[command]]
    redis, url = start_redis_server()
    try:  # once a ResponseError traceback
        assert main([*args, "--redis", url.rpartition("/")[0] + "/99", "--data-dir", str(tmp_path)]) == 2
    finally:
        stop_redis_server(redis)
    assert "refuses the connection: DB index is out of range" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@contextlib.contextmanager
def _immutable(path: Path):
    """`path` made unwritable even for root (which file modes do not stop) while the block runs."""
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (it needs root and a file system with it)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.mark.parametrize("problem, setting, reason", [
    ("its folder is a file", "--store", "[Errno 17] File exists"),
    ("not a database", "--store", "file is not a database"),
    ("the default store is not a database", "--data-dir", "file is not a database"),
    ("read-only", "--store", "attempt to write a readonly database"),
])
def test_an_unusable_sqlite_store_is_refused_before_any_model_loads(problem, setting, reason,
                                                                     tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    path = data / "store.db"
    if problem == "its folder is a file":
        (tmp_path / "file").write_text("")
        path = tmp_path / "file" / "store.db"
    elif problem == "the default store is not a database":
        path = data / "switchboard.db"
    if "not a database" in problem:
        path.write_text("some notes, not a database\n")
    if problem == "read-only":
        sqlite3.connect(path).close()
    store = [] if setting == "--data-dir" else ["--store", f"sqlite://{path}"]
    argv = ["serve", "--model", f"gone={tmp_path / 'nowhere'}", "--data-dir", str(data), *store]
    with _immutable(path) if problem == "read-only" else contextlib.nullcontext():
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"switchboard serve: {setting}: cannot use {path} as the SQLite store: {reason}" in err
    assert "cannot serve 'gone'" not in err  # refused before the model was looked at


def test_a_model_folder_that_cannot_be_served_is_refused_before_any_model_loads(
        demo_model_dir, tmp_path, capsys):
    """Models load one by one, for minutes each on a GPU: a typo in the last one's path was said
    once the others had loaded."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    for path, reason in [(tmp_path / "nowhere", "does not exist"),
                         (broken, "config.json lacks 'num_attention_heads', which a llama config has")]:
        config = tmp_path / "models.toml"
        config.write_text(f'[models.good]\npath = "{demo_model_dir}"\n[models.bad]\npath = "{path}"\n')
        argv = ["serve", "--config", str(config), "--data-dir", str(tmp_path / "data"), "--port", "0"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"switchboard serve: cannot serve 'bad' from {path}: {path}" in err and reason in err
        assert "Loading" not in err and "Traceback" not in err  # no model's progress bar


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_data_dir_that_cannot_be_made_is_refused_before_any_model_loads(command, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    data = tmp_path / "file" / "data"
    extra = ["--redis", "redis://127.0.0.1:1/0"] if command == "worker" else []
    argv = [command, "--model", f"gone={tmp_path / 'nowhere'}", "--data-dir", str(data), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"switchboard {command}: --data-dir: cannot make the folder {data}: " in err
    assert "Traceback" not in err and "cannot serve 'gone'" not in err


def test_a_first_start_without_room_for_the_demo_model_says_to_free_disk_space(tmp_path, capsys):
    """Its store fits on the volume, the demo model does not (it was a traceback, exit 1)."""
    with small_volume(tmp_path / "volume", "4m") as volume:
        assert main(["serve", "--data-dir", str(volume / "data"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    demo = volume / "data" / DEMO_MODEL
    assert f"switchboard serve: --data-dir: cannot write the demo model to {demo} (" in err
    assert err.rstrip().endswith("): free disk space on that volume") and "Traceback" not in err


def test_a_restart_on_a_full_volume_says_to_free_disk_space(tmp_path, capsys):
    """SQLite opens its store there with "disk I/O error" (the WAL's shared memory cannot grow),
    which the message once left at that, and the files stayed open."""
    with small_volume(tmp_path / "volume", "4m") as volume:
        data = volume / "data"
        asyncio.run(_open_and_close(data))  # served before
        filler = fill_volume(volume)
        assert main(["serve", "--model", f"gone={tmp_path / 'nowhere'}", "--data-dir", str(data)]) == 2
        filler.unlink()
    err = capsys.readouterr().err
    assert f"switchboard serve: --data-dir: cannot use {data / 'switchboard.db'} as the SQLite store (" in err
    assert f"): free disk space on the volume of {data}" in err


async def _open_and_close(data_dir: Path) -> None:
    store = await open_store(None, data_dir)
    await store.close()


@contextlib.contextmanager
def _redis_for(command: str) -> Iterator[list[str]]:
    """The options giving a worker a live Redis while the block runs (none for serve)."""
    if command != "worker":
        yield []
        return
    redis, url = start_redis_server()
    try:
        yield ["--redis", url]
    finally:
        stop_redis_server(redis)


def _run_until_refused(command: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`switchboard COMMAND ARGV`, run to its end; a worker's Redis (checked before the settings
    these tests break) is a live one."""
    with _redis_for(command) as redis:
        return subprocess.run(SWITCHBOARD + [command, *argv, *redis], capture_output=True,
                              text=True, timeout=60)


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_an_adapter_folder_that_cannot_be_made_is_refused_before_any_model_loads(command, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    if command == "serve":
        folder, option = tmp_path / "file", "--adapter-dir"
    else:  # a worker keeps the adapter files gateways send it in DATA_DIR/worker-adapters
        folder, option = data / "worker-adapters", "--data-dir"
    folder.write_text("")
    extra = ["--adapter-dir", str(folder)] if command == "serve" else []
    argv = ["--model", f"gone={tmp_path / 'nowhere'}", "--data-dir", str(data), *extra]
    result = _run_until_refused(command, argv)
    assert (result.returncode, result.stderr) == (
        2, f"switchboard {command}: {option}: cannot make the folder {folder}: File exists\n")


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_a_port_in_use_is_refused_before_any_model_loads(command, demo_model_dir, tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as other_server:
        port = other_server.getsockname()[1]
        argv = ["--model", f"{DEMO_MODEL}={demo_model_dir}", "--data-dir", str(tmp_path),
                "--port", str(port)]
        result = _run_until_refused(command, argv)
    assert (result.returncode, result.stderr) == (
        2, f"switchboard {command}: --port: cannot listen on 127.0.0.1:{port}: Address already in use\n")


def test_port_0_is_one_port_on_every_address_of_the_host(monkeypatch):
    """As `localhost` names ::1 and 127.0.0.1 on most hosts: each address once drew a port of its
    own, and the URL announced named the first's alone."""
    import gateway.cli as cli

    both = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: both)
    sockets = cli._bind("localhost", 0)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(sockets) == 2 and len(ports) == 1
        assert cli._base_url("localhost", sockets) == f"http://localhost:{ports.pop()}"
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_sigterm_shuts_down_gracefully_and_exits_0(command, demo_model_dir, tmp_path):
    # What systemd, Docker and Kubernetes send to stop a service; once the process died of it
    # after the graceful shutdown (status -15), before closing its engines.
    port = free_port()
    argv = [command, "--port", str(port), "--data-dir", str(tmp_path), "--model",
            f"{DEMO_MODEL}={demo_model_dir}", "--kv-cache-memory", "16MiB"]
    with _redis_for(command) as redis:
        process = subprocess.Popen(SWITCHBOARD + argv + redis, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        try:
            _wait_for_health(f"http://127.0.0.1:{port}", process)
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate(timeout=60)  # 1.5 s here, 17 s seen on a loaded host
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, stderr
    assert "Finished server process" in stderr and "Traceback" not in stderr, stderr


def test_a_shutdown_drops_the_requests_still_running_at_its_deadline_and_settles_them(tmp_path):
    from tests.test_gateway_upstream import _stalled  # NOTE: here: that module imports this one

    # An upstream that streams one token, then nothing.
    with run_server(Starlette(routes=[Mount("/v1", app=_stalled)])) as stalled:
        config = tmp_path / "stuck.toml"
        config.write_text(f'[models.stuck]\nupstream = "{stalled}/v1"\ntimeout_s = 600\n')
        port, home = free_port(), tmp_path / "home"
        env = {**os.environ, "SWITCHBOARD_ADMIN_KEY": ADMIN_KEY, "SWITCHBOARD_HOME": str(home)}
        command = SWITCHBOARD + ["serve", "--config", str(config), "--port", str(port),
                                 "--shutdown-timeout", "1"]
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_for_health(url, process)
            key = GatewayServer(url, ADMIN_KEY, None).new_tenant("acme", rpm=2)
            with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                    "model": "stuck", "prompt": "hi", "max_tokens": 50, "stream": True},
                    headers={"Authorization": f"Bearer {key}"}) as stream, \
                    socket.create_connection(("127.0.0.1", port)) as upload:
                lines = stream.iter_lines()  # NOTE: kept: a dropped iterator closes the stream
                assert next(lines).startswith("data: ")  # the one token
                # An adapter upload whose client stops sending halfway through its body.
                upload.sendall(b"POST /v1/adapters HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                               + key.encode() + b"\r\nContent-Type: multipart/form-data; "
                               b"boundary=b\r\nContent-Length: 1000\r\n\r\n--b\r\n")
                # NOTE: the server reads its connections in the order they came, so once this later
                # one is answered it is handling the upload; signalled before it has read the
                # upload's head, it would close that connection as idle (1 task cancelled, not 2).
                assert httpx.get(url + "/health", timeout=30).status_code == 200
                stopping = time.monotonic()
                process.send_signal(signal.SIGTERM)
                _, stderr = process.communicate(timeout=20)  # once never: it waited for both
                stopped_after_s = time.monotonic() - stopping
                answer = upload.makefile("rb").read().decode()  # it had no answer yet
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, stderr
    assert 1 <= stopped_after_s < 10, stderr
    assert "Cancel 2 running task(s), timeout graceful shutdown exceeded" in stderr
    head, body = answer.split("\r\n\r\n", 1)
    assert head.startswith("HTTP/1.1 503 ") and "retry-after: 2" in head.lower()
    assert json.loads(body)["error"]["code"] == "server_shutdown"

    async def usage() -> tuple[Usage, bool]:
        """The tenant's usage, and whether its rpm takes another call now."""
        store = await open_store(None, home)
        try:
            rate = await store.check_and_consume_rate(await store.get_tenant("acme"), requests=1)
            return await store.get_usage("acme"), rate.allowed
        finally:
            await store.close()

    # Billed as if its client had gone: the token streamed, and no budget left held. The upload,
    # which its client is told to send again, gave its request back to rpm.
    billed, takes_another_call = asyncio.run(usage())
    assert (billed.requests, billed.tokens_out, billed.reserved_tokens) == (1, 1, 0), billed
    assert takes_another_call


def test_ctrl_c_while_the_model_loads_exits_without_a_traceback(demo_model_dir, tmp_path):
    command = SWITCHBOARD + ["serve", "--port", str(free_port()), "--data-dir", str(tmp_path),
                             "--model", f"{DEMO_MODEL}={demo_model_dir}"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if f"loading {DEMO_MODEL}" in line:
                break
    finally:
        process.send_signal(signal.SIGINT)  # in the seconds the model takes to load
        try:
            _, stderr = process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()  # it lost the signal: leave no server behind on the port
            raise
    assert "Traceback" not in stderr, stderr
    assert process.returncode in (130, 0)  # 0: it had loaded, and shut down as a server does


def test_ctrl_c_before_the_server_listens_for_it_stops_the_server_as_it_starts(
        demo_model_dir, tmp_path, monkeypatch, caplog):
    """A Ctrl-C while asyncio set up the server's loop, before uvicorn listened for signals,
    cancelled the server unstarted (exit 1), or was lost and the server served on."""
    from gateway.http_server import Server

    real_run = Server.run

    def run_after_a_ctrl_c(self, sockets=None):
        signal.raise_signal(signal.SIGINT)
        return real_run(self, sockets=sockets)

    monkeypatch.setattr(Server, "run", run_after_a_ctrl_c)
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        status = main(["serve", "--port", "0", "--data-dir", str(tmp_path),
                       "--model", f"{DEMO_MODEL}={demo_model_dir}"])
    assert status == 0
    assert "Application startup complete." in caplog.text and "Shutting down" in caplog.text
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _lock_once_loaded(monkeypatch, store_file: Path) -> sqlite3.Connection:
    """A connection that takes the SQLite store's write lock (as a backup or an sqlite3 shell
    does) once `serve` has loaded its model, after the store was checked: roll it back to free it."""
    import gateway.cli as cli

    other = sqlite3.connect(store_file, isolation_level=None, check_same_thread=False)
    real_load = cli._load_engine

    def load_then_lock(*args, **kwargs):
        engine = real_load(*args, **kwargs)
        other.execute("BEGIN IMMEDIATE")
        return engine

    monkeypatch.setattr(cli, "_load_engine", load_then_lock)
    return other


@pytest.mark.parametrize("locked", ["once loaded", "at start"])
def test_a_store_locked_for_seconds_is_waited_for(demo_model_dir, tmp_path, monkeypatch, caplog,
                                                  locked):
    """A lock held for seconds once the models are loaded (minutes for a large one) failed the
    start with a traceback and exit status 3; one held as `serve` started, with exit status 2."""
    from gateway.http_server import Server

    if locked == "once loaded":
        other = _lock_once_loaded(monkeypatch, tmp_path / "switchboard.db")
    else:
        other = sqlite3.connect(tmp_path / "switchboard.db", isolation_level=None,
                                check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")
    real_run = Server.run

    def run_then_stop(self, sockets=None):  # the server starts, then stops as on a Ctrl-C
        signal.raise_signal(signal.SIGINT)
        return real_run(self, sockets=sockets)

    monkeypatch.setattr(Server, "run", run_then_stop)
    freed = threading.Thread(target=lambda: (
        eventually(lambda: "cannot use the store yet" in caplog.text, timeout_s=120),
        other.execute("ROLLBACK")))
    try:
        with caplog.at_level(logging.INFO):
            freed.start()
            status = main(["serve", "--port", "0", "--data-dir", str(tmp_path),
                           "--model", f"{DEMO_MODEL}={demo_model_dir}"])
    finally:
        freed.join()
        other.close()
    assert status == 0
    assert "stayed locked by another process" in caplog.text
    assert "Application startup complete." in caplog.text


def test_a_store_still_locked_after_the_wait_exits_2_saying_so(demo_model_dir, tmp_path,
                                                               monkeypatch, capsys):
    import gateway.cli as cli

    monkeypatch.setattr(cli, "STORE_WAIT_S", 0.0)
    other = _lock_once_loaded(monkeypatch, tmp_path / "switchboard.db")
    try:
        status = main(["serve", "--port", "0", "--data-dir", str(tmp_path),
                       "--model", f"{DEMO_MODEL}={demo_model_dir}"])
    finally:
        other.close()
    err = capsys.readouterr().err
    assert status == 2, err
    assert ("switchboard serve: --data-dir: the store still cannot take writes after 0 s: the "
            f"SQLite store {tmp_path / 'switchboard.db'} stayed locked by another process") in err
    assert "Traceback" not in err


@pytest.mark.parametrize("command, has_own_store", [("worker", False), ("serve", True),
                                                    ("serve", False)])
def test_a_registry_redis_gone_once_the_model_is_loaded_exits_2_saying_so(
        command, has_own_store, demo_model_dir, tmp_path, monkeypatch, capsys):
    """A worker's Redis, or the registry's of a gateway whose store is another or that one, gone
    while the model loaded: waited for as a store is, then a clear exit 2 naming --redis (a
    traceback, exit 3, once the model had loaded: minutes on a GPU; a gateway whose store it was
    named --store, which it had not been given)."""
    import gateway.cli as cli

    monkeypatch.setattr(cli, "STORE_WAIT_S", 0.0)
    redis, url = start_redis_server()
    real_load = cli._load_engine

    def load_then_stop_redis(*args, **kwargs):
        engine = real_load(*args, **kwargs)
        stop_redis_server(redis)
        return engine

    monkeypatch.setattr(cli, "_load_engine", load_then_stop_redis)
    own_store = ["--store", f"sqlite:///{tmp_path / 'own.db'}"] if has_own_store else []
    try:
        status = main([command, "--port", "0", "--data-dir", str(tmp_path), "--redis", url,
                       *own_store, "--model", f"{DEMO_MODEL}={demo_model_dir}"])
    finally:
        stop_redis_server(redis)
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"switchboard {command}: --redis: the Redis still cannot take writes after 0 s: " in err
    assert "Traceback" not in err


@pytest.mark.parametrize("sig, status", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_a_signal_while_serve_waits_for_its_store_stops_it_at_once(demo_model_dir, tmp_path, sig,
                                                                    status):
    """As while the models load: it was ignored until the wait ended, a minute later."""
    command = SWITCHBOARD + ["serve", "--port", str(free_port()), "--data-dir", str(tmp_path),
                             "--model", f"{DEMO_MODEL}={demo_model_dir}"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    other = None
    try:
        for line in process.stderr:
            if f"loading {DEMO_MODEL}" in line:  # the store was made and checked: lock it
                other = sqlite3.connect(tmp_path / "switchboard.db", isolation_level=None)
                other.execute("BEGIN IMMEDIATE")
            if "cannot use the store yet" in line:
                break
        process.send_signal(sig)
        started = time.monotonic()
        _, stderr = process.communicate(timeout=STORE_WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()  # it ignored the signal: leave no server behind
            process.wait()
        if other is not None:
            other.close()
    assert process.returncode == status, stderr
    # NOTE: well before the wait's end; not much sooner: on a loaded machine the interpreter's
    # teardown after torch takes up to some 10 s of its own.
    assert time.monotonic() - started < STORE_WAIT_S / 2
    assert "Traceback" not in stderr, stderr


def test_help_gives_the_engine_s_own_defaults(capsys):
    from engine.config import EngineConfig

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"most requests in one batch (default {EngineConfig.max_num_seqs})" in text
    assert f"token budget of one step (default {EngineConfig.max_num_batched_tokens})" in text


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["router", "train"]])
def test_the_readme_names_every_option_of_the_help(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    options = set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert sorted(o for o in options if not re.search(rf"(?<![\w-]){o}(?![\w-])", readme)) == []


def test_a_config_file_takes_the_long_options_names(tmp_path):
    config = tmp_path / "worker.toml"
    config.write_text("heartbeat = 2.5\nmax-num-seqs = 3\nshutdown-timeout = 5\n")
    loaded = load_serve_config({}, config, {}, command="worker")
    assert (loaded.heartbeat_s, loaded.max_num_seqs, loaded.shutdown_timeout_s) == (2.5, 3, 5.0)
    config.write_text("heartbeet = 2.5\n")
    with pytest.raises(ValueError, match="unknown keys .*: heartbeet; known keys: .*heartbeat,"):
        load_serve_config({}, config, {}, command="worker")


@pytest.mark.parametrize("command, text, key", [
    # Each once started the command, which ignored the setting.
    ("serve", "heartbeat = 5\n", "heartbeat"),
    ("serve", 'advertise-url = "http://10.0.0.7:9000"\n', "advertise_url"),
    ("worker", 'admin_key = "sb-admin-secret"\n', "admin_key"),
    ("worker", 'metrics_key = "scrape-me"\n', "metrics_key"),
    ("worker", 'store = "sqlite://a.db"\n', "store"),
    ("worker", 'adapter_dir = "/srv/adapters"\n', "adapter_dir"),
    ("worker", 'max_upload_size = "1MiB"\n', "max_upload_size"),
    ("worker", 'default_route = "auto"\n[routes.auto]\ntiers = ["a", "b"]\nthreshold = 0.5\n',
     "default_route, routes"),
    ("worker", '[models.demo]\npath = "/models/demo"\nprice_input = 1\n', "models"),
])
def test_a_config_key_of_the_other_command_exits_2_naming_it(command, text, key, tmp_path, capsys):
    config = tmp_path / f"{command}.toml"
    config.write_text(text)
    data = tmp_path / "data"
    argv = [command, "--config", str(config), "--data-dir", str(data), "--port", "0",
            "--model", f"gone={tmp_path / 'nowhere'}", "--redis", "redis://127.0.0.1:1/0"]
    assert main(argv) == 2
    other, one = "worker" if command == "serve" else "serve", "," not in key
    assert capsys.readouterr().err == (
        f"switchboard {command}: {key} in {config} {'is a setting' if one else 'are settings'} of "
        f"switchboard {other}, not of switchboard {command}: remove {'it' if one else 'them'}\n")
    assert not data.exists()  # refused before anything loads
    config.write_text("colour = 1\n")
    with pytest.raises(ValueError, match="unknown keys") as raised:
        load_serve_config({}, config, {}, command=command)
    known = str(raised.value).split("known keys: ")[1].split(", ")
    assert not set(key.split(", ")) & set(known)  # nor listed among the command's own


def test_a_worker_leaves_the_gateway_s_variables_alone():
    # One environment (a shell, a container's) often starts gateways and workers alike.
    environ = {"SWITCHBOARD_ADMIN_KEY": "two words", "SWITCHBOARD_METRICS_KEY": "scrape-me",
               "SWITCHBOARD_HOME": "/srv/sb"}
    worker = load_serve_config({}, None, environ, command="worker")
    assert (worker.admin_key, worker.metrics_key, worker.data_dir) == (None, None, Path("/srv/sb"))


@pytest.mark.parametrize("level, library_level", [("info", logging.WARNING), ("debug", logging.NOTSET)])
@pytest.mark.parametrize("library", ["httpx", "torch"])
def test_chatty_libraries_log_no_info_lines_unless_debugging(level, library, library_level):
    """httpx logs a line per call to a worker or upstream, beside the access log; torch its compiler
    caches' statistics as a server stopped early exits."""
    from gateway.cli import _configure_logging
    library_logger = logging.getLogger(library)
    try:
        library_logger.setLevel(logging.NOTSET)
        _configure_logging(ServeConfig(log_level=level))
        assert library_logger.level == library_level
    finally:
        library_logger.setLevel(logging.NOTSET)
