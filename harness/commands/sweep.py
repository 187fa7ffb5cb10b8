"""``omni-stress sweep SWEEP``: a grid of deploys x load (harness/sweep/grid.py), every point an ordinary cell
of one run directory (resumable, reported, gated), then the map (``sweep.md``, ``sweep.html``, heatmaps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from harness.cli_options import RunArgs, shared_run_options
from harness.commands.run import _preflight, resolve_arm_specs
from harness.config import load_prompts
from harness.errors import UserError
from harness.backends import RunOptions, get_backend
from harness.pipeline import RunPlan, execute, manifest_for, new_run_id
from harness.proc import printable_streams, stdout_to_stderr
from harness.rundir import in_run_dir, open_run_dir, say_when_interrupted, start_manifest
from harness.sim import armcall


@click.command("sweep")
@click.argument("sweep_file", metavar="SWEEP", default="default")
@shared_run_options("sweep")
@click.option("--rules", "rules_path", default=None, metavar="PATH",
              help="Gate rules for the map's verdict and quality knee (default deploy_configs/gates.yaml).")
@click.option("--any-family", is_flag=True,
              help="Apply --rules written for another model family than the sweep's (refused otherwise).")
@click.option("--no-plots", is_flag=True, help="Write sweep.md and sweep.html without the heatmap PNGs.")
def command(sweep_file: str, rules_path: str | None, any_family: bool, no_plots: bool, **values: Any) -> None:
    """Run every grid point of SWEEP (a name in deploy_configs/sweeps/ or a YAML path) for each arm, and map it."""
    printable_streams()
    args = RunArgs.from_click(values)
    with stdout_to_stderr():
        printed = _sweep(sweep_file, args, rules_path, no_plots, any_family)
    click.echo(printed)


def _sweep(sweep_file: str, args: RunArgs, rules_path: str | None, no_plots: bool, any_family: bool = False) -> str:
    from harness.gate import check_rules_family, family_rules_path, load_rules, resolve_rules_path
    from harness.sweep.grid import load_sweep

    sweep = load_sweep(sweep_file)
    # a bad rules file is refused before anything runs; without --rules, the sweep's model family's
    family = args.family or sweep.base.family
    rules = load_rules(resolve_rules_path(rules_path) if rules_path is not None
                       else family_rules_path(family, f"{sweep.path}: base"))
    check_rules_family(rules, family, f"the sweep {sweep.path}", any_family)
    prompts = load_prompts(args.prompt_set)  # files first: importing a plugin arm may change directory
    arm_specs = resolve_arm_specs(args, sweep.deploys, prompts)
    options = args.run_options(latency=True)
    backend = args.backend
    entry = get_backend(backend)
    if entry.simulated and any(axis.key == "sampling.seed" for axis in sweep.axes):
        # the sim's Talker samples with the run's seed, never the deploy's: the axis would change nothing
        raise UserError(f"{sweep.path}: axes.sampling.seed: the sim's Talker samples with the run's seed (--seed; "
                        "repeat r uses seed + r - 1), not the deploy's sampling.seed; sweep seeds with --seed and "
                        "--repeat (on the real backend the axis reaches the server)")
    deploys = sweep.deploys
    entry.prepare(args, options, None)
    for deploy in deploys:  # vLLM's scheduler rules, per point: the error names the sweep file and the point
        try:
            _preflight(backend, [], [deploy], RunOptions(backend=backend, asr="none", serve=options.serve))
        except UserError as exc:
            text = str(exc)
            prefix = f"{deploy.path}: "
            raise UserError(f"{sweep.path}: point {deploy.name}: {text[len(prefix):] if text.startswith(prefix) else text}") \
                from None
    _preflight(backend, arm_specs, [], options)
    armcall.set_limit(args.arm_timeout)

    run_dir = open_run_dir(args.out, args.resume_dir,
                           lambda: args.run_id or _sweep_run_id(sweep.name, arm_specs, deploys))
    return in_run_dir(run_dir, lambda: _locked_sweep(run_dir, args.resume_dir is not None, sweep, arm_specs, prompts,
                                                     options, args.quiet, rules, no_plots))


def _sweep_run_id(name: str, arm_specs, deploys) -> str:
    base = new_run_id(arm_specs, deploys)
    stamp, _, rest = base.partition("-")
    time_part, _, rest = rest.partition("-")
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in name)[:24]
    return f"{stamp}-{time_part}-sweep-{safe}-{rest}"[:100]


def _locked_sweep(run_dir: Path, resume: bool, sweep, arm_specs, prompts, options: RunOptions, quiet: bool, rules,
                  no_plots: bool) -> str:
    plan = RunPlan(run_dir, arm_specs, sweep.deploys, prompts, options)
    say_when_interrupted(run_dir, len(plan.cells) * len(prompts.prompts), "sweep")
    planned = manifest_for(plan)
    planned["sweep"] = sweep.describe()

    def a_sweep(manifest: dict) -> None:
        if not isinstance(manifest.get("sweep"), dict):
            raise UserError(f"--resume {run_dir}: not a sweep's run directory (its manifest has no sweep); "
                            "resume it with `omni-stress run --resume`")

    state = start_manifest(run_dir, planned, resume, a_sweep)
    if not quiet:
        click.echo(f"run directory: {plan.run_dir} ({len(sweep.points)} points x {len(arm_specs)} arms x "
                   f"{options.repeat} repeat{'s' if options.repeat > 1 else ''}, plus the reference)", err=True)
    times = execute(plan, state)

    from harness.sweep.report import build_map, terminal_map, write_sweep_report

    sweep_map = build_map(plan.run_dir, rules)
    write_sweep_report(sweep_map, plots=not no_plots)
    return (terminal_map(sweep_map)
            + f"\n\nwall time per stage: sim {times.sim_wall:.1f} s, TTS {times.tts:.1f} s, ASR {times.asr:.1f} s"
            + f"\nresults: {plan.run_dir} (sweep.md, sweep.html; `omni-stress gate {plan.run_dir}` gates the map)")
