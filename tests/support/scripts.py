"""Loading a file under scripts/ as a module, for tests of its functions, and running its
main() with a command line."""

from __future__ import annotations

import importlib.util
import shlex
import sys
from pathlib import Path
from types import ModuleType
from unittest import mock

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_script(name: str, command_line: str) -> None:
    """scripts/NAME.py's main() as `python scripts/NAME.py COMMAND_LINE` would run it
    (split as a shell would: quote a path with spaces)."""
    with mock.patch.object(sys, "argv", [f"{name}.py", *shlex.split(command_line)]):
        load_script(name).main()
