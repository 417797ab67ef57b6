"""README stays true: its settings table is the one the code generates."""

from __future__ import annotations

from pathlib import Path

from gateway.config import settings_markdown


def test_readme_settings_table_matches_the_code():
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    assert settings_markdown() in readme


def test_readme_metric_table_matches_the_code():
    from gateway.support.metrics import DECLARED, metrics_markdown

    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    assert len(DECLARED) >= 30
    assert metrics_markdown() in readme


def test_readme_embedding_example_mounts_on_a_host_app():
    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    section = readme[readme.index("### In an existing Flask app") :]
    code = section[section.index("```python\n") + 10 :]
    code = code[: code.index("```")]
    assert "PDGateway(app" in code
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    client = namespace["app"].test_client()
    try:
        reply = client.post("/llm/v1/chat/completions", data=b"{")
        assert reply.status_code == 400 and reply.get_json()["error"]["code"] == 400
        assert client.get("/health").status_code == 404  # the host's root stays the host's
    finally:  # its background threads (the engines' /metrics read each second) end with it
        namespace["app"].extensions["pd_gateway"].close()


def test_embedding_doc_shows_the_tested_service_whole():
    root = Path(__file__).resolve().parent.parent
    doc = root.joinpath("docs", "embedding.md").read_text()
    for name in ("legacy_app.py", "gunicorn.conf.py"):
        assert root.joinpath("tests", "embedding", name).read_text().rstrip("\n") in doc, name


def test_no_module_imports_one_above_it_in_the_architecture_table():
    """docs/architecture.md's room table is ordered so that modules import only rooms below
    their own, and each folder's modules stand together (the folders are the layers): read the
    order from the doc, the imports from the code."""
    import ast
    import re

    root = Path(__file__).resolve().parent.parent
    doc = root.joinpath("docs", "architecture.md").read_text()
    order = [
        "gateway." + name[:-3].replace("/", ".")
        for row in re.findall(r"^\| (`[^|]+`) \|", doc, re.M)
        for name in re.findall(r"`([a-z_/]+\.py)`", row)
    ]
    position = {module: i for i, module in enumerate(order)}
    package = root.joinpath("gateway")
    modules = {
        ".".join(("gateway", *p.relative_to(package).with_suffix("").parts))
        for p in package.rglob("*.py")
        if p.name != "__init__.py"
    }
    assert modules == set(position), (
        f"rooms missing from the table: {modules - set(position)}; "
        f"in the table, not in the code: {set(position) - modules}"
    )
    folders = [m.rsplit(".", 1)[0] for m in order if m.count(".") == 2]
    assert all(
        folders[i] == folders[i + 1] or folders[i] not in folders[i + 1 :]
        for i in range(len(folders) - 1)
    ), f"a folder's rooms apart in the table: {folders}"
    upward = []
    for module in modules:
        path = package.joinpath(*module.split(".")[1:]).with_suffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module}: a relative import"
                names = (
                    [f"{node.module}.{a.name}" for a in node.names]
                    if node.module in ("gateway", *(m.rsplit(".", 1)[0] for m in modules))
                    else [node.module]
                )
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            upward += [
                (module, n) for n in names if n in position and position[n] < position[module]
            ]
    assert upward == []


def _headings(text: str) -> list[tuple[int, str]]:
    """The markdown headings of `text` at levels 2 and 3, outside code blocks."""
    out, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith(("## ", "### ")):
            level, _, title = line.partition(" ")
            out.append((len(level), title))
    return out


def _anchor(title: str) -> str:
    import re

    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_readme_contents_list_every_section_in_order():
    import re

    readme = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text()
    contents = readme[readme.index("## Contents\n") :]
    contents = contents[: contents.index("\n\n", contents.index("- ["))]
    listed = re.findall(r"^( *)- \[([^\]]+)\]\(#([^)]+)\)$", contents, re.M)
    sections = [(level, title) for level, title in _headings(readme) if title != "Contents"]
    assert [(2 + len(indent) // 2, title) for indent, title, _ in listed] == sections
    assert all(anchor == _anchor(title) for _, title, anchor in listed)


def test_every_relative_link_in_readme_and_docs_leads_somewhere():
    import re

    root = Path(__file__).resolve().parent.parent
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not ours to check
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif (
                anchor
                and linked.suffix == ".md"
                and anchor not in {_anchor(title) for _, title in _headings(linked.read_text())}
            ):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert broken == []
