"""docs/QUICKSTART.md says what the code does: its commands parse, its llama-server
command has exactly the flags the plan prints, its metric names exist, and the README
links to it at the top."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from proxy import cli
from proxy.server.managed import ServerLayout, verification_flags
from tests.deploy.test_docs import shell_commands

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "docs" / "QUICKSTART.md"


def test_the_readme_links_the_quickstart_near_the_top() -> None:
    top = (REPO / "README.md").read_text().split("\n## ")[0]
    assert "(docs/QUICKSTART.md)" in top


def test_npu_spec_commands_parse(monkeypatch) -> None:
    seen = set()
    for command in shell_commands(QUICKSTART):
        if command[0] != "npu-spec":
            continue
        monkeypatch.setattr(sys, "argv", command)
        cli.build_parser().parse_args(command[1:])  # exits on an unknown option
        seen.add(command[1])
    assert {"doctor", "serve", "export-drafter"} <= seen


def test_the_restart_command_has_the_planned_flags() -> None:
    (restart,) = [c for c in shell_commands(QUICKSTART) if c[0] == "llama-server"]
    planned = verification_flags(ServerLayout(4, 8192), Path("/tmp/npu-spec-slots"))
    own = ["-m", "~/models/Qwen3-32B-Q4_K_M.gguf", "--port", "8081", "-ngl", "99"]
    assert restart[1:] == own + planned


def test_metric_names_exist() -> None:
    source = "".join((REPO / "proxy" / name).read_text() for name in ("metrics.py", "api/app.py"))
    for name in set(re.findall(r"npu_spec_[a-z_]+", QUICKSTART.read_text())):
        if name.endswith("_"):  # a prefix in a grep pattern
            continue
        base = re.sub(r"_(sum|count)$", "", name)
        assert f'"{base}' in source, f"QUICKSTART.md: no metric {name}"


def test_grep_pattern_names_real_metrics() -> None:
    pattern = re.search(r"grep -E '(\^npu_spec_[^']+)'", QUICKSTART.read_text())
    assert pattern is not None
    source = (REPO / "proxy" / "metrics.py").read_text() + (REPO / "proxy/api/app.py").read_text()
    names = set(re.findall(r'"(npu_spec_[a-z_]+)', source))
    regex = re.compile(pattern.group(1))
    matched = {name for name in names if regex.match(name)}
    for wanted in ("accepted_tokens_total", "speculative_ms_per_token", "plain_run_tokens_total"):
        assert f"npu_spec_{wanted}" in matched


def test_the_readme_attached_example_has_the_planned_flags() -> None:
    commands = [c for c in shell_commands(REPO / "README.md") if c[0] == "llama-server"]
    planned = verification_flags(ServerLayout(4, 4096), Path("/tmp/slots"))
    assert commands == [["llama-server", "-m", "model.gguf", "--port", "8081", *planned]]


def _shown_default(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, float) and value.is_integer():
        return f"`{value:g}`"
    return f"`{value}`"


def test_every_setting_is_listed_with_its_default_and_option() -> None:
    from proxy.config import ProxySettings
    from proxy.serve_cmd import FLAGS

    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \| ([^|]+) \| [^|]+ \|$",
                      QUICKSTART.read_text(), re.M)  # fmt: skip
    table = {name: (option.strip(), default.strip()) for name, option, default in rows}
    assert set(table) == set(ProxySettings.model_fields)
    for name, field in ProxySettings.model_fields.items():
        option, default = table[name]
        value = field.default_factory() if field.default_factory else field.default
        assert default == _shown_default(value), name
        assert option == (f"`{FLAGS[name]}`" if name in FLAGS else "(file or variable only)")


def test_the_install_says_how_to_get_a_llama_server() -> None:
    install = QUICKSTART.read_text().split("## 1. Install", 1)[1].split("\n## ", 1)[0]
    assert "pip install ." in install and "brings no llama-server" in install
    for way in ("LLAMA_SERVER", "npu-spec install-server", "PATH"):
        assert way in install, way
