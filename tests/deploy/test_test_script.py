"""scripts/test.sh says what it will do and cost before it starts, and leaves no
temporary files and no test models behind (unless asked to keep the models)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from tests.deploy.stack import REPO

SCRIPT = REPO / "scripts" / "test.sh"


def _fake_checkout(tmp_path: Path) -> tuple[Path, Path]:
    """test.sh in a checkout whose set-up, ruff and pytest are stand-ins: pytest writes a
    temporary file and a test model, as the real suite does."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, repo / "scripts" / "test.sh")
    (repo / "scripts" / "setup_env.sh").write_text("echo 'setting up' >&2\n")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "ruff").write_text("#!/bin/sh\nexit 0\n")
    (tools / "python").write_text(
        "#!/bin/sh\n"
        'echo "pytest $*" > "$TMPDIR/pytest-ran"\n'
        f'cp "$TMPDIR/pytest-ran" "{tmp_path}/seen"\n'
        f'mkdir -p "{repo}/.cache/test-models/small-same" "{repo}/.cache/test-logs"\n'
        "exit 0\n"
    )
    for tool in tools.iterdir():
        tool.chmod(0o755)
    return repo, tools


def _run(repo: Path, tools: Path, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    environ = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "TMPDIR": str(scratch)}
    environ.pop("NPU_SPEC_KEEP_TEST_MODELS", None)  # the suite's own run may keep its models
    return subprocess.run(
        ["bash", str(repo / "scripts" / "test.sh"), "-k", "something"],
        capture_output=True, text=True, env={**environ, **env}, timeout=60, check=False,
    )  # fmt: skip


def test_it_says_what_it_costs_before_it_starts(tmp_path: Path) -> None:
    repo, tools = _fake_checkout(tmp_path)
    done = _run(repo, tools, tmp_path)
    assert done.returncode == 0, done.stderr
    before = done.stderr.split("setting up")[0]  # printed before the set-up runs
    for cost in ("min", "GB", "PyTorch", "llama-server", "test models", "npm",
                 "playwright-core", "apt-get", "root", "skips", "CI=true"):  # fmt: skip
        assert cost in before, cost


def test_it_leaves_no_temporary_files_and_no_test_models(tmp_path: Path) -> None:
    repo, tools = _fake_checkout(tmp_path)
    assert _run(repo, tools, tmp_path).returncode == 0
    ran = (tmp_path / "seen").read_text()
    assert "-k something" in ran and "--basetemp=" in ran  # the arguments reach pytest
    assert list((tmp_path / "tmp").iterdir()) == []  # the run's scratch folder is gone
    assert not (repo / ".cache" / "test-models").exists()
    assert (repo / ".cache" / "test-logs").exists()  # the logs stay for reading


def test_the_models_can_be_kept_for_the_next_run(tmp_path: Path) -> None:
    repo, tools = _fake_checkout(tmp_path)
    assert _run(repo, tools, tmp_path, NPU_SPEC_KEEP_TEST_MODELS="1").returncode == 0
    assert (repo / ".cache" / "test-models" / "small-same").is_dir()
