"""The extension and the gunicorn hooks in process: settings from the host's app.config, a
Gateway per process built on first use, one extension on several apps, install()'s chaining."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from flask import Flask

from gateway import extension
from gateway.config import SettingsError
from gateway.extension import PDGateway
from gateway.gunicorn_conf import install

BAD_BODY = b"{"


def host_app(**config) -> Flask:
    app = Flask("host")
    app.config.update(config)
    return app


def test_settings_come_from_env_then_app_config_then_keywords(monkeypatch):
    monkeypatch.setenv("GATEWAY_PREFILL", "http://env-p:1")
    monkeypatch.setenv("GATEWAY_DECODE", "http://env-d:1")
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "from-env")
    app = host_app(
        PD_GATEWAY_DECODE=["http://config-d:2"],
        PD_GATEWAY_ADMIN_TOKEN="from-config",
        PD_GATEWAY_STORE_TTL=30,
    )  # typed values, as app.config holds them
    PDGateway(app, admin_token="from-code")
    settings = app.extensions["pd_gateway"].settings
    assert settings.prefill == ["http://env-p:1"]
    assert settings.decode == ["http://config-d:2"] and settings.store_ttl == 30.0
    assert settings.admin_token == "from-code"


@pytest.mark.parametrize(
    "config,named",
    [
        ({"PD_GATEWAY_PREFIL": ["http://p:1"]}, "PD_GATEWAY_PREFIL"),  # a typo
        ({"PD_GATEWAY_WORKERS": 0}, "PD_GATEWAY_WORKERS"),
    ],
)
def test_a_bad_config_key_is_named(config, named):
    with pytest.raises(SettingsError, match=named):
        PDGateway(host_app(**config))


def test_one_extension_mounts_on_several_apps_each_with_its_settings():
    pd = PDGateway(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"])
    first, second = host_app(PD_GATEWAY_ADMIN_TOKEN="one"), host_app()
    pd.init_app(first, url_prefix="/llm")
    pd.init_app(second, url_prefix="/v2/gateway")
    try:
        for app, prefix in ((first, "/llm"), (second, "/v2/gateway")):
            reply = app.test_client().post(prefix + "/v1/chat/completions", data=BAD_BODY)
            assert reply.status_code == 400 and reply.get_json()["error"]["code"] == 400
            assert app.test_client().post("/v1/chat/completions", data=BAD_BODY).status_code == 404
        assert first.extensions["pd_gateway"].settings.admin_token == "one"
        assert second.extensions["pd_gateway"].settings.admin_token == ""
        assert first.extensions["pd_gateway"] is not second.extensions["pd_gateway"]
    finally:  # their background threads (reads of the engines, releases) end with them
        first.extensions["pd_gateway"].close()
        second.extensions["pd_gateway"].close()


@pytest.mark.processes
def test_the_gateway_is_built_on_first_use_once_per_process(monkeypatch):
    built = []

    class Counted(extension.Gateway):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(os.getpid())

    monkeypatch.setattr(extension, "Gateway", Counted)
    app = host_app(PD_GATEWAY_PREFILL="127.0.0.1:9", PD_GATEWAY_DECODE="127.0.0.1:9")
    PDGateway(app, url_prefix="/llm")
    mounted = app.extensions["pd_gateway"]
    assert built == []  # nothing at import: the master (--preload) builds none
    client = app.test_client()
    for _ in range(3):
        client.get("/llm/health")
    assert built == [os.getpid()]
    parent = mounted.gateway
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # a worker forked after the parent built its own
        try:
            mine = mounted.gateway
            ok = mine is not parent and mounted.gateway is mine and built[-1] == os.getpid()
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.waitpid(child, 0)
    mounted.close()
    assert mounted.gateway is not parent  # after close, the next use builds a new one
    mounted.close()


def hook(calls: list, name: str, arity: int):
    return {1: lambda server: calls.append(name), 2: lambda server, worker: calls.append(name)}[
        arity
    ]


def test_install_runs_a_configs_own_hooks_after_its_own_and_refuses_late_ones(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    from gunicorn.workers.gthread import ThreadWorker

    calls: list[str] = []
    config = {"worker_class": "gthread", "on_reload": hook(calls, "host on_reload", 1)}
    install(config)
    server = SimpleNamespace(pd_slots={0: "the old worker"})
    config["on_reload"](server)
    assert server.pd_slots == {} and calls == ["host on_reload"]  # pd-gateway's ran, then its
    with pytest.raises(RuntimeError, match="already called"):
        install(config)
    # A hook set after install() replaces pd-gateway's: gunicorn refuses to start, saying so.
    config["post_fork"] = hook(calls, "late post_fork", 2)
    server = SimpleNamespace(
        worker_class=ThreadWorker, cfg=SimpleNamespace(**config), num_workers=2
    )
    with pytest.raises(RuntimeError, match="post_fork hook"):
        config["on_starting"](server)


def test_install_refuses_what_would_break_silently(monkeypatch, tmp_path):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="takes 1 arguments"):
        install({"worker_class": "gthread", "post_fork": lambda server: None})
    # This process imported prometheus_client without the variable: its metrics are its own.
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    with pytest.raises(RuntimeError, match="prometheus_client was imported before install"):
        install({"worker_class": "gthread"})
