"""Every command documents itself: help text on every option, and an epilog with two or three examples."""

from __future__ import annotations

import click
import pytest

from kvledger.cli.main import app, main


def _commands() -> list[click.Command]:
    return [app.commands[name] for name in sorted(app.commands)]


@pytest.mark.parametrize("command", _commands(), ids=lambda c: c.name)
def test_every_option_has_help_and_the_command_has_examples(command):
    undocumented = [p.name for p in command.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not undocumented, f"{command.name}: options without help: {undocumented}"
    assert (command.help or "").strip(), f"{command.name} has no description"
    epilog = command.epilog or ""
    examples = [line for line in epilog.splitlines() if line.strip().startswith("kvledger ")]
    assert epilog.lstrip("\b\n").startswith("Examples:") and 2 <= len(examples) <= 3, command.name


def test_help_prints_the_examples(capsys):
    assert main(["plan", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples:" in out and "kvledger plan --model llama-3.1-8b --device-memory 79.18GiB" in out
    assert main(["--help"]) == 0
    assert "Examples:" in capsys.readouterr().out
