"""``omni-stress sweep SWEEP``: a grid of deploys x load (harness/sweep.py), every point an ordinary cell
of one run directory (resumable, reported, gated), then the map (``sweep.md``, ``sweep.html``, heatmaps)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import click

from harness.cli_options import family_defaults, shared_run_options
from harness.commands.run import _preflight, absolute_paths, in_run_dir, open_run_dir, start_manifest
from harness.config import load_arms, load_prompts, resolve_arm
from harness.errors import UserError
from harness.families import choose_family
from harness.executors.options import executor_options
from harness.pipeline import (
    DEFAULT_SIM_TALKER,
    RunOptions,
    RunPlan,
    execute,
    manifest_for,
    new_run_id,
)
from harness.proc import printable_streams, stdout_to_stderr
from harness.rundir import check_run_id
from harness.sim import armcall


@click.command("sweep")
@click.argument("sweep_file", metavar="SWEEP", default="default")
@shared_run_options("sweep")
@click.option("--rules", "rules_path", default=None, metavar="PATH",
              help="Gate rules for the map's verdict and quality knee (default deploy_configs/gates.yaml).")
@click.option("--no-plots", is_flag=True, help="Write sweep.md and sweep.html without the heatmap PNGs.")
@executor_options
def command(sweep_file, arms, arms_file, prompt_set, repeat, seed, out, run_id, resume_dir, backend, sim_talker, asr,
            asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet, model, health_timeout,
            request_timeout, serve_platform, serve_python, arm_timeout, rules_path, no_plots, executor,
            ray_address, family) -> None:
    """Run every grid point of SWEEP (a name in deploy_configs/sweeps/ or a YAML path) for each arm, and map it."""
    printable_streams()
    picked = family_defaults(family, arms=arms, prompt_set=prompt_set)
    arms, prompt_set = picked["arms"], picked["prompt_set"]
    if run_id is not None:
        check_run_id(run_id)
    # Every path once, now, as `run` does: a plugin arm may os.chdir() when it is imported or called.
    out, resume_dir, cache_dir, arms_file, serve_python, asr_model = absolute_paths(
        out, resume_dir, cache_dir, arms_file, serve_python, asr_model)
    with stdout_to_stderr():
        printed = _sweep(sweep_file, arms, arms_file, prompt_set, repeat, seed, out, run_id, resume_dir, backend,
                         sim_talker, asr, asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet,
                         model, health_timeout, request_timeout, serve_platform, serve_python, arm_timeout,
                         rules_path, no_plots, executor, ray_address, family)
    click.echo(printed)


def _sweep(sweep_file, arms, arms_file, prompt_set, repeat, seed, out, run_id, resume_dir, backend, sim_talker, asr,
           asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet, model, health_timeout,
           request_timeout, serve_platform, serve_python, arm_timeout, rules_path, no_plots, executor="local",
           ray_address=None, family=None) -> str:
    from harness.gate import load_rules, resolve_rules_path
    from harness.sweep import load_sweep

    sweep = load_sweep(sweep_file)
    rules = load_rules(resolve_rules_path(rules_path))  # a bad rules file is refused before anything runs
    prompts = load_prompts(prompt_set)  # files first: importing a plugin arm may change directory
    known = load_arms(arms_file) if arms_file else load_arms()
    arm_specs = [resolve_arm(a, known) for a in arms]
    names = [a.name for a in arm_specs]
    if len(set(names)) != len(names):
        raise UserError(f"--arm: arm names must be unique, got {', '.join(names)}")
    fam = choose_family(family, sweep.deploys, prompts, arm_specs)
    arm_specs = [replace(a, family=fam.name) if a.source == "--arm" else a for a in arm_specs]
    options = RunOptions(backend=backend, repeat=repeat, seed=seed, asr=asr, asr_model=asr_model,
                         beam_size=beam_size, cache_dir=cache_dir, use_cache=not no_cache, quiet=quiet,
                         asr_workers=-1 if asr_workers is None else asr_workers,
                         sim_workers=-1 if sim_workers is None else sim_workers, sim_talker=sim_talker,
                         executor=executor, ray_address=ray_address, latency=True)
    if backend != "sim" and sim_talker != DEFAULT_SIM_TALKER:
        raise UserError(f"--sim-talker {sim_talker} applies to --backend sim")
    deploys = sweep.deploys
    if backend == "vllm-omni":
        from harness.serve.backend import ServeOptions

        options.serve = ServeOptions(model=model, health_timeout_s=health_timeout, request_timeout_s=request_timeout,
                                     platform=serve_platform, default_python=str(serve_python) if serve_python else None)
    for deploy in deploys:  # vLLM's scheduler rules, per point: the error names the sweep file and the point
        try:
            _preflight(backend, [], [deploy], RunOptions(backend=backend, asr="none", serve=options.serve))
        except UserError as exc:
            text = str(exc)
            prefix = f"{deploy.path}: "
            raise UserError(f"{sweep.path}: point {deploy.name}: {text[len(prefix):] if text.startswith(prefix) else text}") \
                from None
    _preflight(backend, arm_specs, [], options)
    armcall.set_limit(arm_timeout)

    run_dir = open_run_dir(out, resume_dir, lambda: run_id or _sweep_run_id(sweep.name, arm_specs, deploys))
    return in_run_dir(run_dir, lambda: _locked_sweep(run_dir, resume_dir is not None, sweep, arm_specs, prompts,
                                                     options, quiet, rules, no_plots))


def _sweep_run_id(name: str, arm_specs, deploys) -> str:
    base = new_run_id(arm_specs, deploys)
    stamp, _, rest = base.partition("-")
    time_part, _, rest = rest.partition("-")
    safe = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in name)[:24]
    return f"{stamp}-{time_part}-sweep-{safe}-{rest}"[:100]


def _locked_sweep(run_dir: Path, resume: bool, sweep, arm_specs, prompts, options: RunOptions, quiet: bool, rules,
                  no_plots: bool) -> str:
    plan = RunPlan(run_dir, arm_specs, sweep.deploys, prompts, options)
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

    from harness.sweep_report import build_map, terminal_map, write_sweep_report

    sweep_map = build_map(plan.run_dir, rules)
    write_sweep_report(sweep_map, plots=not no_plots)
    return (terminal_map(sweep_map)
            + f"\n\nwall time per stage: sim {times.sim_wall:.1f} s, TTS {times.tts:.1f} s, ASR {times.asr:.1f} s"
            + f"\nresults: {plan.run_dir} (sweep.md, sweep.html; `omni-stress gate {plan.run_dir}` gates the map)")
