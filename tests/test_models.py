"""Several models behind one gateway (--models, --models-file): each model its own P and D
pools, a request routed by the model it names, an unknown model vLLM's 404 before any engine
call, no conversation crossing models; /v1/models asked of a healthy instance first."""

from __future__ import annotations

import pytest
import requests
import responses

from devtools.processes import models_toml
from emulator.process import EmulatorProcess
from gateway.config import Settings, SettingsError
from tests.helpers.servers import gateway_process, starts_processes
from tests.helpers.transport import ResponsesTransport

CHAT = "/v1/chat/completions"


# --- settings ---------------------------------------------------------------------------------


def test_models_as_flags_and_as_a_file_name_their_engines(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text(
        '[[model]]\nname = "llama"\nadapters = ["sql-lora"]\n'
        'prefill = ["http://p1:8100", "p2:8100"]\ndecode = ["http://d1:8200"]\n'
    )
    settings = Settings.from_args(
        [
            "--models-file",
            str(path),
            "--models",
            "coder;prefill=http://p3:8100;decode=d3:8200;aliases=code,dev",
        ]
    )
    llama, coder = settings.model_specs()
    assert (llama.name, llama.prefill, llama.decode, llama.adapters) == (
        "llama",
        ["http://p1:8100", "http://p2:8100"],
        ["http://d1:8200"],
        ["sql-lora"],
    )
    assert (coder.name, coder.prefill, coder.decode, coder.aliases) == (
        "coder",
        ["http://p3:8100"],
        ["http://d3:8200"],
        ["code", "dev"],
    )
    # The environment carries the flags' form, one model per word.
    again = Settings.from_env(settings.to_env())
    assert again.model_specs() == settings.model_specs()


def test_without_models_the_one_pool_is_prefill_and_decode():
    (only,) = Settings(prefill=["http://p:1"], decode=["http://d:2"]).model_specs()
    assert (only.name, only.prefill, only.decode) == ("", ["http://p:1"], ["http://d:2"])


@pytest.mark.parametrize(
    "models, error",
    [
        (["a;prefill=http://p:1"], "needs at least one decode URL"),
        (["a;prefill=http://p:1;decode=http://d:2;colour=red"], "unknown key(s) colour"),
        (["a;prefill=http://p:1;decode"], "is not key=value"),
        (["a;prefill=ftp://p:1;decode=http://d:2"], "is not an http://host:port URL"),
        (
            ["a;prefill=http://p:1;decode=http://d:2", "b;prefill=http://p:3;decode=http://d:2"],
            "http://d:2 serves two models ('a' and 'b')",
        ),
        (
            [
                "a;prefill=http://p:1;decode=http://d:2;aliases=b",
                "b;prefill=http://p:3;decode=http://d:4",
            ],
            "the model name 'b' is given twice",
        ),
    ],
)
def test_a_models_setting_that_cannot_work_is_refused_at_start(models, error):
    with pytest.raises(SettingsError) as raised:
        Settings(models=models)
    assert error in str(raised.value)


def test_a_models_file_that_is_not_model_tables_is_refused(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[model]\nname = "x"\n')
    with pytest.raises(SettingsError, match=r"expected \[\[model\]\] tables only"):
        Settings(models_file=str(path))
    path.write_text('[[model]]\nname = "x\n')
    with pytest.raises(SettingsError, match="models.toml"):
        Settings(models_file=str(path))


@responses.activate
def test_models_asks_healthy_instances_first_with_a_short_timeout():
    from gateway.config import Settings
    from gateway.service import Gateway

    gateway = Gateway(
        Settings(
            engine_metrics_interval=0,
            probe_interval=0,
            prefill=["http://10.9.0.1:8100"],
            decode=["http://10.9.0.2:8200", "http://10.9.0.3:8200"],
        ),
        transport=ResponsesTransport(),
    )
    try:
        gateway.decode.failed(gateway.decode.instances[0], unreachable=True)
        responses.get("http://10.9.0.3:8200/v1/models", json={"object": "list", "data": []})
        assert gateway.models() == {"object": "list", "data": []}
        (call,) = responses.calls
        assert call.request.url.startswith("http://10.9.0.3:8200")
        assert call.request.req_kwargs["timeout"][1] <= 5
    finally:
        gateway.close()


# --- one gateway, two models, real engines ---------------------------------------------------


@pytest.fixture(scope="module")
@starts_processes
def two_models(tmp_path_factory):
    engines = [
        EmulatorProcess(
            "prefill", host="127.0.0.60", model="chat", itl_ms=1, bidirectional_kv_xfer=True
        ),
        EmulatorProcess(
            "decode", host="127.0.0.61", model="chat", itl_ms=1, bidirectional_kv_xfer=True
        ),
        EmulatorProcess(
            "prefill", host="127.0.0.62", model="coder", itl_ms=1, bidirectional_kv_xfer=True
        ),
        EmulatorProcess(
            "decode", host="127.0.0.63", model="coder", itl_ms=1, bidirectional_kv_xfer=True
        ),
    ]
    p1, d1, p2, d2 = engines
    path = tmp_path_factory.mktemp("models") / "models.toml"
    path.write_text(
        models_toml(
            chat={"aliases": ["assistant"], "prefill": [p1.url], "decode": [d1.url]},
            coder={"prefill": [p2.url], "decode": [d2.url]},
        )
    )
    try:
        with gateway_process([], [], models_file=str(path), workers=2) as gateway:
            yield gateway, engines
    finally:
        for engine in engines:
            engine.stop()


def _turn(gateway, model, messages, **extra):
    # 80-token replies: beyond vLLM's 64-token recompute threshold, so P pulls them from D
    # (P's own prefix cache holds the rest of the history).
    response = requests.post(
        gateway.url + CHAT,
        timeout=20,
        json={"model": model, "messages": messages, "max_tokens": 80, **extra},
    )
    assert response.status_code == 200, response.text
    return response


def _conversation(gateway, model, opening):
    """Two turns of one conversation: the cache header of each, and the history a third turn
    would send."""
    messages = [{"role": "user", "content": opening}]
    first = _turn(gateway, model, messages)
    messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "and then?"}]
    second = _turn(gateway, model, messages)
    messages += [second.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
    return first.headers["X-Gateway-Cache"], second.headers["X-Gateway-Cache"], messages


def test_each_model_is_served_by_its_own_engines_and_reuses_its_own_cache(two_models):
    gateway, (p1, d1, p2, d2) = two_models
    for engine in (p1, d1, p2, d2):
        engine.reset_stats()
    assert _conversation(gateway, "chat", "tell me about ducks")[:2] == ("miss", "hit")
    assert _conversation(gateway, "coder", "write me a parser")[:2] == ("miss", "hit")
    # An alias is its model: the engines get the model's own name (they would 404 the alias).
    assert _conversation(gateway, "assistant", "tell me about geese")[:2] == ("miss", "hit")
    chat = [p1.stats(), d1.stats()]
    coder = [p2.stats(), d2.stats()]
    assert [s["completed"] for s in chat] == [4, 4] and [s["completed"] for s in coder] == [2, 2]
    assert chat[0]["hits"] == 2 and coder[0]["hits"] == 1
    assert all(s["bad_requests"] == 0 and s["wrong_reuse"] == 0 for s in chat + coder)


def test_a_conversation_never_crosses_models(two_models):
    """A chat conversation's next turn sent to the coder finds nothing there (its D never held
    it), and leaves the chat's entry for the chat's own next turn."""
    gateway, (p1, d1, p2, d2) = two_models
    for engine in (p1, d1, p2, d2):
        engine.reset_stats()
    *_, third = _conversation(gateway, "chat", "the same words for both")
    crossed = _turn(gateway, "coder", third)
    assert crossed.headers["X-Gateway-Cache"] == "miss"
    # Not the chat's entry found and refused (decode_gone would drop it): none found at all.
    assert crossed.headers["X-Gateway-Path"] == "two-stage; reason=no_entry"
    assert p2.stats()["pulled_blocks"] == 0 and p2.stats()["failed_pulls"] == 0
    assert _turn(gateway, "chat", third).headers["X-Gateway-Cache"] == "hit"
    assert p1.stats()["hits"] == 2 and d2.stats()["completed"] == 1


def test_an_unknown_model_gets_vllms_404_and_no_engine_call(two_models):
    gateway, engines = two_models
    for engine in engines:
        engine.reset_stats()
    response = requests.post(
        gateway.url + CHAT,
        timeout=10,
        json={"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `gpt-4` does not exist. Valid aliases: chat, assistant, coder.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert all(engine.stats()["requests"] == 0 for engine in engines)


def test_models_lists_every_model_the_gateway_serves(two_models):
    gateway, _ = two_models
    listing = requests.get(gateway.url + "/v1/models", timeout=10).json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["chat", "assistant", "coder"]
    assert all(m["object"] == "model" for m in listing["data"])


def test_an_engine_is_added_to_the_model_named(two_models):
    gateway, (p1, d1, p2, d2) = two_models
    headers = {"Authorization": f"Bearer {gateway.admin_token}"}
    url = gateway.url + "/admin/instances"
    missing = requests.post(url, headers=headers, json={"role": "decode", "url": d2.url})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "model"
    unknown = requests.post(
        url, headers=headers, json={"role": "decode", "url": d2.url, "model": "gpt-4"}
    )
    assert unknown.status_code == 404
    added = requests.post(
        url,
        headers=headers,
        timeout=10,
        json={"role": "decode", "url": "http://127.0.0.63:9", "model": "coder"},
    )
    assert added.status_code == 201, added.text
    assert (added.json()["model"], added.json()["name"]) == ("coder", "coder/decode[1]")
    report = requests.get(url, headers=headers, timeout=10).json()
    assert set(report["models"]) == {"chat", "coder"}
    assert [i["name"] for i in report["models"]["coder"]["decode"]] == [
        "coder/decode[0]",
        "coder/decode[1]",
    ]
    assert [i["name"] for i in report["models"]["chat"]["decode"]] == ["chat/decode[0]"]
    removed = requests.delete(
        url,
        headers=headers,
        timeout=10,
        json={"role": "decode", "url": "http://127.0.0.63:9", "model": "coder"},
    )
    assert removed.status_code == 200, removed.text
