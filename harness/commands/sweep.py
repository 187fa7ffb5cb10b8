"""``omni-stress sweep SWEEP``: a grid of deploys x load (harness/sweep.py), every point an ordinary cell
of one run directory (resumable, reported, gated), then the map (``sweep.md``, ``sweep.html``, heatmaps)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from harness.commands.run import _finite, _preflight
from harness.config import MAX_SEED, load_arms, load_prompts, resolve_arm
from harness.errors import UserError
from harness.executors.options import executor_options
from harness.pipeline import (
    DEFAULT_SIM_TALKER,
    SIM_TALKERS,
    RunOptions,
    RunPlan,
    check_resume,
    execute,
    manifest_for,
    new_run_id,
    prepare_run_dir,
)
from harness.proc import printable_streams, stdout_to_stderr
from harness.records import MANIFEST_FILE, write_manifest
from harness.rundir import (
    DISK_FULL,
    check_run_files,
    check_run_id,
    check_same_scoring,
    disk_full_error,
    locked,
    read_resumable_manifest,
)
from harness.sim import armcall


@click.command("sweep")
@click.argument("sweep_file", metavar="SWEEP", default="default")
@click.option("--arm", "arms", multiple=True, default=("main", "pr"), show_default=True,
              help="Arm from deploy_configs/arms.yaml, or NAME=package.module:attr. Repeatable.")
@click.option("--arms-file", type=click.Path(path_type=Path), default=None,
              help="Arms YAML to resolve --arm names in (default deploy_configs/arms.yaml).")
@click.option("--prompts", "prompt_set", default="default", show_default=True,
              help="Prompt set name (prompts/NAME.yaml) or a YAML path.")
@click.option("--repeat", type=click.IntRange(1, 100), default=1, show_default=True,
              help="Run each point N times; sim repeat r uses seed + r - 1 (its sampling and arrival jitter).")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=42, show_default=True,
              help="Talker sampling seed, also the sim's arrival draws (jitter, Poisson gaps).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
              help="Folder for run directories.")
@click.option("--run-id", default=None, help="Name of the run directory inside --out (default: timestamp, "
              "'sweep', the sweep's name and a random suffix).")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path), default=None,
              help="Continue an interrupted sweep: recorded requests are kept, the rest run (same sweep file).")
@click.option("--backend", type=click.Choice(["sim", "vllm-omni"]), default="sim", show_default=True)
@click.option("--sim-talker", type=click.Choice(list(SIM_TALKERS)), default=DEFAULT_SIM_TALKER, show_default=True,
              help="sim: the simulated Talker (see `omni-stress run --help`).")
@click.option("--asr", type=click.Choice(["faster-whisper", "openai-whisper", "none"]), default="none",
              show_default=True, help="'none' scores the oracle transcript (a sweep has many cells; Whisper is "
              "available as for run).")
@click.option("--asr-model", default="base", show_default=True, help="tiny.en, base, or a local model path.")
@click.option("--beam-size", type=click.IntRange(1, 10), default=1, show_default=True)
@click.option("--asr-workers", type=click.IntRange(0, 64), default=None,
              help="Whisper worker processes (default: 2 on 2+ cores).")
@click.option("--sim-workers", type=click.IntRange(0, 64), default=None,
              help="Sim cells simulated at once in forked processes (default: 2 on 2+ cores).")
@click.option("--cache-dir", type=click.Path(path_type=Path), default=None,
              help="Transcript/model cache (default $OMNI_STRESS_CACHE_DIR or ~/.cache/omni-stress).")
@click.option("--no-cache", is_flag=True, help="Do not read or write the transcript cache on disk.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
@click.option("--model", default="Qwen/Qwen2.5-Omni-7B", show_default=True,
              help="vllm-omni backend: model path or name given to `vllm serve`.")
@click.option("--health-timeout", type=float, callback=_finite, default=1800.0, show_default=True,
              help="vllm-omni backend: seconds to wait for /health.")
@click.option("--request-timeout", type=float, callback=_finite, default=900.0, show_default=True,
              help="vllm-omni backend: seconds per request.")
@click.option("--platform", "serve_platform", type=click.Choice(["auto", "gpu", "cpu"]), default="auto",
              show_default=True, help="vllm-omni backend: the server's platform profile.")
@click.option("--serve-python", type=click.Path(path_type=Path), default=None,
              help="vllm-omni backend: interpreter for arms without a serve: entry.")
@click.option("--arm-timeout", type=click.FloatRange(0, 86400), callback=_finite, default=armcall.DEFAULT_LIMIT_S,
              show_default=True, help="sim: seconds one talker_preprocess call may take (0: no limit).")
@click.option("--rules", "rules_path", default=None, metavar="PATH",
              help="Gate rules for the map's verdict and quality knee (default deploy_configs/gates.yaml).")
@click.option("--no-plots", is_flag=True, help="Write sweep.md and sweep.html without the heatmap PNGs.")
@executor_options
def command(sweep_file, arms, arms_file, prompt_set, repeat, seed, out, run_id, resume_dir, backend, sim_talker, asr,
            asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet, model, health_timeout,
            request_timeout, serve_platform, serve_python, arm_timeout, rules_path, no_plots, executor,
            ray_address) -> None:
    """Run every grid point of SWEEP (a name in deploy_configs/sweeps/ or a YAML path) for each arm, and map it."""
    printable_streams()
    if run_id is not None:
        check_run_id(run_id)
    with stdout_to_stderr():
        printed = _sweep(sweep_file, arms, arms_file, prompt_set, repeat, seed, out, run_id, resume_dir, backend,
                         sim_talker, asr, asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet,
                         model, health_timeout, request_timeout, serve_platform, serve_python, arm_timeout,
                         rules_path, no_plots, executor, ray_address)
    click.echo(printed)


def _sweep(sweep_file, arms, arms_file, prompt_set, repeat, seed, out, run_id, resume_dir, backend, sim_talker, asr,
           asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet, model, health_timeout,
           request_timeout, serve_platform, serve_python, arm_timeout, rules_path, no_plots, executor="local",
           ray_address=None) -> str:
    from harness.gate import load_rules, resolve_rules_path
    from harness.sweep import load_sweep

    sweep = load_sweep(sweep_file)
    rules = load_rules(resolve_rules_path(rules_path))  # a bad rules file is refused before anything runs
    known = load_arms(arms_file) if arms_file else load_arms()
    arm_specs = [resolve_arm(a, known) for a in arms]
    names = [a.name for a in arm_specs]
    if len(set(names)) != len(names):
        raise UserError(f"--arm: arm names must be unique, got {', '.join(names)}")
    prompts = load_prompts(prompt_set)
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

    if resume_dir is not None:
        if not (resume_dir / MANIFEST_FILE).is_file():
            raise UserError(f"--resume {resume_dir}: not a run directory (no {MANIFEST_FILE})")
        check_run_files(resume_dir)
        run_dir = resume_dir
    else:
        run_dir = prepare_run_dir(out, run_id or _sweep_run_id(sweep.name, arm_specs, deploys))
    with locked(run_dir):
        try:
            return _locked_sweep(run_dir, resume_dir is not None, sweep, arm_specs, prompts, options, quiet, rules,
                                 no_plots)
        except OSError as exc:
            if exc.errno in DISK_FULL:
                raise disk_full_error(exc, run_dir) from None
            raise


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
    if resume:
        manifest = read_resumable_manifest(run_dir)
        if not isinstance(manifest.get("sweep"), dict):
            raise UserError(f"--resume {run_dir}: not a sweep's run directory (its manifest has no sweep); "
                            "resume it with `omni-stress run --resume`")
        check_same_scoring(run_dir, manifest, planned)
        state = check_resume(run_dir, planned)
        manifest.setdefault("resumed", []).append(" ".join(sys.argv))
        manifest["finished"] = None
        write_manifest(run_dir, manifest)
    else:
        write_manifest(run_dir, planned)
        state = None
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
