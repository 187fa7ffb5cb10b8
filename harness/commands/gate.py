"""``omni-stress gate RUN_DIR``: the CI verdict. Exit 0 pass, 1 a rule failed, 2 could not evaluate.

Only a complete run is gated: one that did not finish, lost a record to a torn line, has a
missing or duplicated (arm, deploy, repeat, prompt) record, or records its manifest does not
list, is refused with one line and exit 2 (``summary.run_problems``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from harness.config import slo_option

from harness import gate
from harness.gate.verdict import refusal
from harness.report import summary
from harness.errors import UserError
from harness.proc import printable_streams


@click.command("gate")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--rules", "rules_path", default=None, metavar="PATH",
              help="Rules YAML (default: the run's model family's, deploy_configs/gates.yaml for Qwen2.5-Omni; "
                   "a bare name is looked up in deploy_configs/).")
@click.option("--junit", "junit_path", type=click.Path(path_type=Path), default=None,
              help="Also write JUnit XML (one testcase per rule x cell) for CI.")
@click.option("--any-family", is_flag=True,
              help="Apply --rules written for another model family than the run's (refused otherwise).")
@click.option("--role", "roles", multiple=True, metavar="ARM=ROLE",
              help="Gate ARM in ROLE (baseline or candidate) instead of the role its run recorded: a plugin arm "
                   "given as --arm NAME=... runs as a candidate; --role NAME=baseline gates it as the release "
                   "expected to show the bug. Repeatable.")
@click.option("--slo", "slo_text", default=None, metavar="ttfp_s=S,max_stall_s=S",
              help="Goodput's streaming SLO for every cell instead of each deploy's slo: (a key left out is "
                   "unbounded; default without either: no stall over 0.1 s).")
def command(run_dir: Path, rules_path: str | None, junit_path: Path | None, any_family: bool,
            roles: tuple[str, ...], slo_text: str | None) -> None:
    """Check RUN_DIR against the gate rules and exit 0 (pass), 1 (a rule failed) or 2 (could not evaluate)."""
    printable_streams()
    try:
        rules = gate.load_rules(gate.resolve_rules_path(rules_path)) if rules_path is not None else None
        run = summary.load_run(run_dir, codec_tokens=False)  # no rule reads the tokens (issue 48)
        from harness.rundir import manifest_family

        family = manifest_family(run.manifest)
        if rules is None:  # the run's family's rules (Qwen2.5-Omni's: deploy_configs/gates.yaml)
            rules = gate.load_rules(gate.family_rules_path(family, f"{run_dir}/manifest.json: family"))
        gate.check_rules_family(rules, family, f"the run {run_dir}", any_family)
        refused = refusal(run)  # the same reasons the pages' verdict line gives
        if refused is not None:
            raise UserError(refused)
        slo = slo_option(slo_text) if slo_text is not None else None
        cells = summary.with_slo(with_roles(summary.summarize_cells(run), roles, run_dir), slo)
        if isinstance(run.manifest.get("sweep"), dict):  # a sweep's run: the gate over its map
            _gate_map(run, rules, junit_path, cells)
        result = gate.evaluate(rules, cells, run_id=run.run_id)
    except UserError as exc:
        if junit_path is not None:  # CI still gets a report that says why
            _write(junit_path, gate.junit_error_xml(str(exc)))
        raise
    click.echo(gate.format_result(result), nl=False)
    if junit_path is not None:
        _write(junit_path, gate.junit_xml(result))
        click.echo(f"wrote JUnit: {junit_path}", err=True)
    sys.exit(result.exit_code)


def with_roles(cells: list[summary.CellSummary], roles: tuple[str, ...], run_dir: Path) -> list[summary.CellSummary]:
    """``cells`` with the ``--role ARM=ROLE`` overrides applied; an unknown arm or role is one line naming it."""
    import dataclasses

    arms = list(dict.fromkeys(c.arm for c in cells))
    chosen: dict[str, str] = {}
    for item in roles:
        arm, sep, role = item.partition("=")
        if not sep or not arm:
            raise UserError(f"--role {item!r}: expected ARM=ROLE (ROLE baseline or candidate)")
        if arm not in arms:
            raise UserError(f"--role {item}: the run {run_dir} has no arm {arm!r} (its arms: {', '.join(arms)})")
        if role not in summary.ROLES:
            raise UserError(f"--role {item}: role {role!r} for arm {arm!r}; expected {' or '.join(summary.ROLES)}")
        chosen[arm] = role
    return [dataclasses.replace(c, role=chosen[c.arm]) if c.arm in chosen else c for c in cells]


def _gate_map(run: summary.Run, rules: gate.Rules, junit_path: Path | None,
              cells: list[summary.CellSummary]) -> None:
    """A sweep's run directory (``omni-stress sweep``): each grid point gated by the rules of its base
    deploy, candidates in every stressed cell, the baseline failing in one (``harness.sweep.gate``)."""
    from harness.sweep.gate import evaluate_map, format_map_verdict, map_junit_xml

    verdict = evaluate_map(rules, cells, run.manifest["sweep"])
    click.echo(format_map_verdict(verdict, verbose=True), nl=False)
    if junit_path is not None:
        _write(junit_path, map_junit_xml(verdict, run.run_id))
        click.echo(f"wrote JUnit: {junit_path}", err=True)
    sys.exit(verdict.exit_code)


def _write(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{path}: cannot write JUnit XML ({exc.strerror})") from None
