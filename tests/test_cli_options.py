"""Click options defined once (harness/cli_options.py) and typed once (``RunArgs``): every option of
``run`` and ``sweep`` is a ``RunArgs`` field or one of the command's own few, and the typed values
are what the user gave (paths absolute, the family's defaults where nothing was given)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import click
import click.testing

from harness.cli_options import RunArgs
from harness.commands.run import command as run_command
from harness.commands.sweep import command as sweep_command


def _params(command: click.Command) -> set[str]:
    return {p.name for p in command.params if p.name}


def test_every_run_and_sweep_option_is_a_runargs_field():
    typed = {f.name for f in fields(RunArgs)}
    assert _params(run_command) == typed
    assert _params(sweep_command) == (typed - {"deploys", "dry_run"}) | {"sweep_file", "rules_path", "no_plots", "any_family"}


def test_from_click_types_the_values_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    seen: list[RunArgs] = []

    @click.command()
    @click.pass_context
    def probe(ctx, **values):
        seen.append(RunArgs.from_click(values))

    probe.params = list(run_command.params)
    res = click.testing.CliRunner().invoke(probe, ["--out", "rel", "--family", "qwen2.5-omni", "--arm", "pr"],
                                           catch_exceptions=False)
    assert res.exit_code == 0, res.output
    args = seen[0]
    assert args.out == tmp_path / "rel"
    assert args.arms == ("pr",)  # given: kept
    assert args.deploys == ("reference", "stress") and args.prompt_set == "default"  # the family's defaults
    assert args.run_options().sim_workers == -1 and args.run_options(latency=True).latency is True
    assert isinstance(args.out, Path)
