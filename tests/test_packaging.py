"""One ``kvpool`` import namespace: the repository's folders install as ``kvpool.<folder>``,
no generic top-level module is importable, the master and store node start without torch,
and a wheel built by ``python -m build`` installs in a fresh venv and runs ``kvpool demo``."""
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _py(code: str, cwd: str, python: str = sys.executable, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_no_generic_top_level_modules(tmp_path):
    code = ("import importlib.util as u; "
            "print([n for n in ('cli', 'master', 'storenode', 'protocol', 'connector') if u.find_spec(n)])")
    p = _py(code, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_master_and_store_node_do_not_import_torch(tmp_path):
    code = ("import sys, kvpool, kvpool.master.server, kvpool.storenode.server, kvpool.cli.app; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'numpy.testing')); "
            "assert not bad, bad")
    p = _py(code, cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr


# a meta path finder that makes vLLM unimportable, as in an environment without it
HIDE_VLLM = (
    "import sys, importlib.abc\n"
    "class NoVLLM(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'vllm' or name.startswith('vllm.'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r} (hidden)', name=name)\n"
    "sys.meta_path.insert(0, NoVLLM())\n")


def test_the_store_tests_collect_without_vllm():
    """``pytest tests -m "not vllm"`` (docs/development.md: the store alone) collects every
    test module with vLLM unimportable; modules that need vLLM skip themselves."""
    code = HIDE_VLLM + ("import pytest\n"
                        "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', '-m', 'not vllm', "
                        "'tests']))\n")
    p = _py(code, cwd=str(REPO), timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "error" not in p.stdout.splitlines()[-1], p.stdout[-3000:]


def test_public_api_names():
    import kvpool
    from kvpool.client import AsyncKVPoolClient, KVPoolClient
    from kvpool.errors import KVPoolError, NotFound

    assert kvpool.KVPoolClient is KVPoolClient and kvpool.AsyncKVPoolClient is AsyncKVPoolClient
    assert issubclass(NotFound, KVPoolError) and kvpool.NotFound is NotFound
    with pytest.raises(AttributeError):
        kvpool.no_such_name  # noqa: B018


def _site_packages(python: str) -> str:
    return subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   text=True).strip()


@pytest.mark.slow
def test_wheel_installs_in_a_fresh_venv_and_runs_the_demo(tmp_path):
    """``python -m build --wheel``, then a fresh venv that gets the wheel and nothing from the
    repository. Its third-party dependencies come from this venv through a .pth file (which
    does not load this venv's editable finder), so the test needs no package index."""
    import build  # noqa: F401 - the test extra installs it (pyproject [test])
    # build from a copy: setuptools leaves build/ in the source tree, whose stale files a
    # later wheel would ship
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "__pycache__",
                                                             "*.egg-info", ".pytest_cache"))
    dist = tmp_path / "dist"
    b = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert b.returncode == 0, b.stdout[-2000:] + b.stderr[-2000:]
    wheels = list(dist.glob("kvpool-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    deps = _site_packages(sys.executable)
    Path(_site_packages(py), "deps.pth").write_text(deps + "\n")
    i = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheels[0])],
                       capture_output=True, text=True, timeout=300)
    assert i.returncode == 0, i.stderr[-2000:]
    with tempfile.TemporaryDirectory() as cwd:
        p = _py("import kvpool, kvpool.cli.app, sys; print(kvpool.__file__)", cwd=cwd, python=py)
        assert p.returncode == 0, p.stderr
        assert str(venv) in p.stdout, p.stdout  # the wheel's copy, not the repository's
        p = _py("from kvpool.protocol.config import DEFAULT_CONFIG as D; print(D.is_file(), D)", cwd=cwd, python=py)
        assert p.stdout.startswith(f"True {venv}"), p.stdout + p.stderr  # the default config --config names
        p = _py("import cli", cwd=cwd, python=py)
        assert p.returncode != 0 and "No module named 'cli'" in p.stderr
        d = subprocess.run([str(venv / "bin" / "kvpool"), "demo", "--quick", "--json"], cwd=cwd, capture_output=True,
                           text=True, timeout=600, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert d.returncode == 0, d.stdout[-2000:] + d.stderr[-3000:]
