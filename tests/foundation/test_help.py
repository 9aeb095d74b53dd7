"""Every option of every subcommand explains itself in `--help`."""

from __future__ import annotations

import argparse
import shlex

import pytest

from proxy import cli
from proxy.config import ProxySettings
from proxy.serve_cmd import settings_from_args


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    module = cli._module(cli.SUBCOMMANDS[name][0])
    module.add_arguments(parser)
    return parser


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_option_has_help_text(name: str) -> None:
    parser = _subparser(name)
    silent = [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not (action.help or "").strip() or action.help == argparse.SUPPRESS
    ]
    assert silent == [], f"npu-spec {name}: options without help: {silent}"


def _serve_options() -> list[argparse.Action]:
    return [
        action
        for action in _subparser("serve")._actions
        if action.option_strings and action.dest not in ("help", "config")
    ]


@pytest.mark.parametrize("action", _serve_options(), ids=lambda a: a.option_strings[0])
def test_every_serve_option_states_its_default_and_variable(action: argparse.Action) -> None:
    if action.dest in ("target", "upstream"):  # no default: exactly one is required
        assert "give this or" in action.help
    elif action.const != "off":  # --no-overlap is --overlap off
        assert "(default: " in action.help
    assert f"[NPU_SPEC_{action.dest.upper()}" in action.help


@pytest.mark.parametrize("action", _serve_options(), ids=lambda a: a.option_strings[0])
def test_stated_defaults_are_the_settings_defaults(action: argparse.Action) -> None:
    field = ProxySettings.model_fields[action.dest]
    if action.nargs == 0 or field.default is None or field.default_factory is not None:
        return  # a switch, or a default in words (a free port, all cores, ...)
    shown = action.help.split("(default: ")[1].split(")")[0]
    default = field.default
    if isinstance(default, bool):
        default = "on" if default else "off"
    assert shown == str(default)


def test_serve_help_explains_environment_config_and_server_args() -> None:
    parser = argparse.ArgumentParser()
    cli._module("proxy.serve_cmd").add_arguments(parser)
    text = parser.format_help()
    assert "NPU_SPEC_" in text and "--config FILE" in text and "NPU_SPEC_CONFIG" in text
    assert "--server-arg '-ngl 99' --server-arg=--no-mmap" in text


def test_server_arg_keeps_a_flag_with_its_value() -> None:
    parser = _subparser("serve")
    line = "--upstream x:1 --server-arg '-ngl 99' --server-arg=--no-mmap"
    line += " --server-arg '-a \"my model\"'"
    args = parser.parse_args(shlex.split(line))
    assert settings_from_args(args).server_args == ["-ngl", "99", "--no-mmap", "-a", "my model"]


def test_the_upstream_key_help_says_when_managed_mode_makes_one() -> None:
    (action,) = [a for a in _serve_options() if a.dest == "upstream_api_key"]
    # managed mode makes a random server key only when clients need a key (serve_cmd)
    assert "managed, a random one when --api-key is set, else none" in action.help


def test_the_settings_without_an_option_are_named_in_the_help() -> None:
    from proxy.serve_cmd import EPILOG, FLAGS

    for name in set(ProxySettings.model_fields) - set(FLAGS):
        assert name in EPILOG, name
    assert "docs/QUICKSTART.md" in EPILOG
