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


def test_readme_embedding_example_mounts_on_a_host_app():
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    section = readme[readme.index("### In an existing Flask app"):]
    code = section[section.index("```python\n") + 10:]
    code = code[:code.index("```")]
    assert "PDGateway(app" in code
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    client = namespace["app"].test_client()
    reply = client.post("/llm/v1/chat/completions", data=b"{")
    assert reply.status_code == 400 and reply.get_json()["error"]["code"] == 400
    assert client.get("/health").status_code == 404     # the host's root stays the host's


def test_embedding_doc_shows_the_tested_service_whole():
    root = Path(__file__).resolve().parent.parent
    doc = root.joinpath("docs", "embedding.md").read_text()
    for name in ("legacy_app.py", "gunicorn.conf.py"):
        assert root.joinpath("tests", "embedding", name).read_text().rstrip("\n") in doc, name
