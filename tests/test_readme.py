"""README stays true: its settings table is the one the code generates."""
from __future__ import annotations

from pathlib import Path

from gateway.config import settings_markdown


def test_readme_settings_table_matches_the_code():
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    assert settings_markdown() in readme


def test_readme_lists_every_metric():
    from gateway import metrics
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    names = [m.name + ("_total" if m.type == "counter" else "")
             for value in vars(metrics).values()
             if isinstance(value, (metrics.Counter, metrics.Histogram))
             for m in value.describe()]
    assert len(names) >= 9
    assert [n for n in names if f"`{n}`" not in readme] == []


def test_blueprint_mounts_on_another_flask_app():
    from flask import Flask

    from gateway.service import Gateway
    from gateway.config import Settings
    from gateway.views import create_blueprint
    legacy = Flask("legacy")
    legacy.register_blueprint(create_blueprint(Gateway(Settings(prefill=["http://127.0.0.1:9"],
                                                                decode=["http://127.0.0.1:9"]))))
    reply = legacy.test_client().post("/v1/chat/completions", data=b"{")
    assert reply.status_code == 400 and reply.get_json()["error"]["code"] == 400
