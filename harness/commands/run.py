"""``omni-stress run``: the experiment of the seed, on the sim (default) or a real deployment."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from harness.config import ArmSpec, Deploy, PromptSet, load_arms, load_deploy, load_prompts
from harness.talkers import load_impl, resolve_arm
from harness.errors import UserError
from harness.family import choose_family
from harness.cli_options import finite_seconds as _finite  # noqa: F401 - its old name
from harness.cli_options import RunArgs, shared_run_options
from harness.backends import DEFAULT_SIM_TALKER, RunOptions, get_backend
from harness.pipeline import RunPlan, execute, manifest_for, new_run_id
from harness.proc import printable_streams, stdout_to_stderr
from harness.rundir import in_run_dir, open_run_dir, say_when_interrupted, start_manifest
from harness.sim import armcall


@click.command("run")
@shared_run_options("run")
def command(**values: Any) -> None:
    """Run the prompts through every arm x deploy, transcribe the Talker audio, tabulate WER and events."""
    printable_streams()
    args = RunArgs.from_click(values)
    # Whatever an arm (or a library) prints while the run works goes to stderr: stdout is the table's.
    with stdout_to_stderr():
        printed = _run(args)
    click.echo(printed)


def _run(args: RunArgs) -> str:
    """The run; returns what goes to stdout (the tables), printed once stdout is stdout again."""
    deploy_specs = [load_deploy(d) for d in args.deploys]  # files first: importing a plugin arm may change directory
    if len({d.name for d in deploy_specs}) != len(deploy_specs):
        raise UserError(f"--deploy: deploy names must be unique, got {', '.join(d.name for d in deploy_specs)}")
    prompts = load_prompts(args.prompt_set)
    arm_specs = resolve_arm_specs(args, deploy_specs, prompts)
    options = args.run_options()
    entry = get_backend(args.backend)
    entry.prepare(args, options, prompts)
    if args.dry_run:
        run_dir = (args.resume_dir or args.out / (args.run_id or new_run_id(arm_specs, deploy_specs)))
        return entry.dry_run(arm_specs, deploy_specs, run_dir, options)
    _preflight(args.backend, arm_specs, deploy_specs, options, prompts)
    armcall.set_limit(args.arm_timeout)  # before any sim worker is forked: they inherit it

    run_dir = open_run_dir(args.out, args.resume_dir, lambda: args.run_id or new_run_id(arm_specs, deploy_specs))
    return in_run_dir(run_dir, lambda: _locked_run(run_dir, args.resume_dir is not None, arm_specs, deploy_specs,
                                                    prompts, options, args.quiet))


def resolve_arm_specs(args: RunArgs, deploys: list[Deploy], prompts: PromptSet) -> list[ArmSpec]:
    """``--arm`` resolved in the arms file, names unique, every arm of the run's model family
    (``harness.family.choose_family``); a command-line arm takes the run's family. ``--sim-talker``
    is checked here too: it names a Talker of the family's sim, and only the sim has one."""
    known = load_arms(args.arms_file) if args.arms_file else load_arms()
    arm_specs = [resolve_arm(a, known, load=False) for a in args.arms]  # loaded below, in the run's family
    names = [a.name for a in arm_specs]
    if len(set(names)) != len(names):
        raise UserError(f"--arm: arm names must be unique, got {', '.join(names)}")
    fam = choose_family(args.family, deploys, prompts, arm_specs)
    simulated = get_backend(args.backend).simulated
    if not simulated and args.sim_talker != DEFAULT_SIM_TALKER:
        raise UserError(f"--sim-talker {args.sim_talker} applies to --backend sim (the real server runs its own "
                        "Talker: the speaking tiny checkpoint speaks by the same rules)")
    if simulated and args.sim_talker not in fam.sim_talkers:
        raise UserError(f"--sim-talker {args.sim_talker}: the {fam.name} family's sim has the Talkers "
                        f"{', '.join(fam.sim_talkers)}")
    arm_specs = [replace(a, family=fam.name) if a.source == "--arm" else a for a in arm_specs]
    for a in arm_specs:  # an upstream arm's code is read and compiled now, for its family's hook and stand-in
        if a.talker.startswith("vllm-omni:"):
            load_impl(a)
    return arm_specs


def _locked_run(run_dir: Path, resume: bool, arm_specs: list[ArmSpec], deploy_specs: list[Deploy], prompts,
                options: RunOptions, quiet: bool) -> str:
    plan = RunPlan(run_dir, arm_specs, deploy_specs, prompts, options)
    say_when_interrupted(run_dir, len(plan.cells) * len(prompts.prompts), "run")
    state = start_manifest(run_dir, manifest_for(plan), resume)
    if not quiet:
        click.echo(f"run directory: {plan.run_dir}", err=True)
    times = execute(plan, state)

    from harness.report.tables import load_run, summarize_cells, terminal_table, write_reports

    run = load_run(plan.run_dir, codec_tokens=False)  # read once, for the files and the printed tables
    cells = summarize_cells(run)
    from harness.gate.verdict import page_verdict

    write_reports(run, cells, page_verdict(run, cells))  # the page opens with the gate's verdict
    return (terminal_table(run, cells)
            + f"\n\nwall time per stage: sim {times.sim_wall:.1f} s, TTS {times.tts:.1f} s, ASR {times.asr:.1f} s "
              f"({times.asr_transcribed} transcribed, {times.asr_cache_hits} cache hits)"
            + (f", {times.asr_wait:.1f} s waiting for Whisper at the end" if times.asr_wait >= 0.05 else "")
            + f"\nresults: {plan.run_dir}")


def _preflight(backend: str, arm_specs: list[ArmSpec], deploy_specs: list[Deploy], options: RunOptions,
               prompts: PromptSet | None = None) -> None:
    """Checks that need no run: a broken plugin arm, scheduler settings vLLM refuses, a real-backend
    arm that cannot be started, a reply the sim would mis-score, or a missing ASR model is refused
    before a run directory exists (the backend's own checks are its entry's, ``harness.backends``)."""
    get_backend(backend).preflight(arm_specs, deploy_specs, options, prompts)
    if options.asr != "none":
        from harness.audio.asr import make_transcriber

        make_transcriber(options.asr, options.asr_model, options.beam_size)
