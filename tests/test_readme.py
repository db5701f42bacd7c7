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
