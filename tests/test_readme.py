"""The README's library snippet runs as written against a real cluster."""
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_library_snippet_runs(cluster):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    scope: dict = {}
    exec(compile(code.replace("tcp://127.0.0.1:PORT", cluster.master_addr), "README.md", "exec"), scope)
    assert scope["n_hit"] == 6


def test_first_lines_are_the_two_fresh_machine_commands():
    lines = [ln.strip() for ln in README.read_text().splitlines()[1:6] if ln.strip()]
    assert lines[0].startswith("bash .ci/setup && .venv/bin/kvpool demo")
    assert lines[1].startswith("bash .ci/run")


def test_readme_and_docs_link_only_files_inside_the_repository():
    root = README.parent
    docs = [README, *sorted((root / "docs").glob("*.md"))]
    assert len(docs) > 1, "the long sections live in docs/"
    for doc in docs:
        text = doc.read_text()
        assert "shared/" not in text and "/work/" not in text, f"{doc.name} names a path outside the repository"
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            assert not re.match(r"[a-z]+:", target), f"{doc.name} links {target}: keep links inside the repository"
            path = (doc.parent / target.split("#", 1)[0]).resolve()
            assert path.is_relative_to(root), f"{doc.name} links {target}, outside the repository"
            assert path.exists(), f"{doc.name} links {target}, which does not exist"
