"""``omni-stress run``: the experiment of the seed, on the sim (default) or a real deployment."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from harness.config import ArmSpec, Deploy, PromptSet, load_arms, load_deploy, load_prompts, resolve_arm
from harness.errors import ConfigError, UserError, out_of_memory
from harness.families import choose_family
from harness.cli_options import finite_seconds as _finite  # noqa: F401 - its old name
from harness.cli_options import family_defaults, shared_run_options
from harness.executors.options import executor_options
from harness.pipeline import (
    DEFAULT_SIM_TALKER,
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
    absolute,
    check_run_files,
    check_run_id,
    check_same_scoring,
    disk_full_error,
    locked,
    out_of_memory_error,
    pin_path_env,
    read_resumable_manifest,
)
from harness.sim import armcall


@click.command("run")
@shared_run_options("run")
@executor_options
def command(arms, arms_file, deploys, prompt_set, repeat, seed, out, run_id, resume_dir, backend, sim_talker, asr,
            asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet, dry_run, model, health_timeout,
            request_timeout, serve_platform, serve_python, arm_timeout, executor, ray_address, family) -> None:
    """Run the prompts through every arm x deploy, transcribe the Talker audio, tabulate WER and events."""
    printable_streams()
    picked = family_defaults(family, arms=arms, deploys=deploys, prompt_set=prompt_set)
    arms, deploys, prompt_set = picked["arms"], picked["deploys"], picked["prompt_set"]
    if run_id is not None:
        check_run_id(run_id)
    # Every path once, now: a plugin arm may os.chdir() when it is imported or called, and a
    # relative --out (or cache, model, resume folder) must still mean what the user typed.
    out, resume_dir, cache_dir, arms_file, serve_python, asr_model = absolute_paths(
        out, resume_dir, cache_dir, arms_file, serve_python, asr_model)
    # Whatever an arm (or a library) prints while the run works goes to stderr: stdout is the table's.
    with stdout_to_stderr():
        printed = _run(arms, arms_file, deploys, prompt_set, repeat, seed, out, run_id, resume_dir, backend, asr,
                       asr_model, beam_size, asr_workers, sim_workers, cache_dir, no_cache, quiet, dry_run, model,
                       health_timeout, request_timeout, arm_timeout, serve_platform, serve_python, sim_talker,
                       executor, ray_address, family)
    click.echo(printed)


def absolute_paths(out, resume_dir, cache_dir, arms_file, serve_python, asr_model):
    """The path options of ``run`` and ``sweep`` made absolute, and the environment's cache folders
    pinned, once as the command starts: a plugin arm may os.chdir() when imported or called."""
    out, resume_dir, cache_dir, arms_file = absolute(out), absolute(resume_dir), absolute(cache_dir), absolute(arms_file)
    serve_python = absolute(serve_python) if serve_python is not None and serve_python.exists() else serve_python
    pin_path_env()
    return out, resume_dir, cache_dir, arms_file, serve_python, _absolute_model(asr_model)


def _absolute_model(model: str) -> str:
    """``--asr-model``: a path (one that exists, or is written as a path) made absolute; a model name
    (``base``, ``tiny.en``, an openai-whisper name) kept."""
    from harness.audio.asr import PACKAGED_MODELS

    if model in PACKAGED_MODELS:
        return model
    looks_like_path = os.sep in model or model.startswith(("~", ".")) or model.endswith(".pt")
    if looks_like_path or os.path.exists(model):
        return str(absolute(model))
    return model


def _run(arms, arms_file, deploys, prompt_set, repeat, seed, out, run_id, resume_dir, backend, asr, asr_model, beam_size,
         asr_workers, sim_workers, cache_dir, no_cache, quiet, dry_run, model, health_timeout, request_timeout,
         arm_timeout, serve_platform="auto", serve_python=None, sim_talker=DEFAULT_SIM_TALKER, executor="local",
         ray_address=None, family=None) -> str:
    """The run; returns what goes to stdout (the tables), printed once stdout is stdout again."""
    known = load_arms(arms_file) if arms_file else load_arms()
    arm_specs = [resolve_arm(a, known) for a in arms]
    names = [a.name for a in arm_specs]
    if len(set(names)) != len(names):
        raise UserError(f"--arm: arm names must be unique, got {', '.join(names)}")
    deploy_specs = [load_deploy(d) for d in deploys]
    if len({d.name for d in deploy_specs}) != len(deploy_specs):
        raise UserError(f"--deploy: deploy names must be unique, got {', '.join(d.name for d in deploy_specs)}")
    prompts = load_prompts(prompt_set)
    fam = choose_family(family, deploy_specs, prompts, arm_specs)
    arm_specs = [replace(a, family=fam.name) if a.source == "--arm" else a for a in arm_specs]
    options = RunOptions(backend=backend, repeat=repeat, seed=seed, asr=asr, asr_model=asr_model,
                         beam_size=beam_size, cache_dir=cache_dir, use_cache=not no_cache, quiet=quiet,
                         asr_workers=-1 if asr_workers is None else asr_workers,
                         sim_workers=-1 if sim_workers is None else sim_workers, sim_talker=sim_talker)
    options.executor, options.ray_address = executor, ray_address
    if backend != "sim" and sim_talker != DEFAULT_SIM_TALKER:
        raise UserError(f"--sim-talker {sim_talker} applies to --backend sim (the real server runs its own Talker: "
                        "the speaking tiny checkpoint speaks by the same rules)")
    if backend == "vllm-omni":
        from harness.serve.backend import ServeOptions, describe_cell

        with_audio = [p.id for p in prompts.prompts if p.audio_seconds]
        if with_audio:
            raise UserError(f"{prompts.path}: prompt {with_audio[0]!r}: audio_seconds inputs are simulated only; "
                            "the vllm-omni backend sends text prompts")

        options.serve = ServeOptions(model=model, health_timeout_s=health_timeout, request_timeout_s=request_timeout,
                                     platform=serve_platform, default_python=str(serve_python) if serve_python else None)
        if dry_run:
            run_dir = (resume_dir or out / (run_id or new_run_id(arm_specs, deploy_specs)))
            return "\n".join(describe_cell(a, d, run_dir, options.serve) for a in arm_specs for d in deploy_specs)
    elif dry_run:
        raise UserError("--dry-run applies to --backend vllm-omni (the sim has no commands to print)")
    _preflight(backend, arm_specs, deploy_specs, options, prompts)
    armcall.set_limit(arm_timeout)  # before any sim worker is forked: they inherit it

    run_dir = open_run_dir(out, resume_dir, lambda: run_id or new_run_id(arm_specs, deploy_specs))
    return in_run_dir(run_dir, lambda: _locked_run(run_dir, resume_dir is not None, arm_specs, deploy_specs, prompts,
                                                    options, quiet))


def open_run_dir(out: Path, resume_dir: Path | None, run_id: Callable[[], str]) -> Path:
    """``--resume``'s run directory (checked), else a new one named ``run_id()`` inside ``out``."""
    if resume_dir is not None:
        if not (resume_dir / MANIFEST_FILE).is_file():
            raise UserError(f"--resume {resume_dir}: not a run directory (no {MANIFEST_FILE})")
        check_run_files(resume_dir)  # before the lock: .lock itself may be the planted link
        return resume_dir
    return prepare_run_dir(out, run_id())


def in_run_dir(run_dir: Path, work: Callable[[], str]) -> str:
    """``work()`` holding the run directory's lock; a full disk or exhausted memory is one line naming it."""
    with locked(run_dir):
        try:
            return work()
        except (OSError, MemoryError, ImportError) as exc:
            if isinstance(exc, OSError) and exc.errno in DISK_FULL:
                raise disk_full_error(exc, run_dir) from None
            if not out_of_memory(exc):
                raise
            exc.__traceback__ = None  # free what the failed frames held before the message is built
            raise out_of_memory_error(exc, run_dir) from None


def start_manifest(run_dir: Path, planned: dict[str, Any], resume: bool,
                   check: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """A new run writes its planned manifest; a resumed one checks the recorded manifest against it
    (``check`` first: a command's own condition), notes the command line and returns what is done."""
    if not resume:
        write_manifest(run_dir, planned)
        return None
    manifest = read_resumable_manifest(run_dir)
    if check is not None:
        check(manifest)
    check_same_scoring(run_dir, manifest, planned)
    state = check_resume(run_dir, planned)
    manifest.setdefault("resumed", []).append(" ".join(sys.argv))
    manifest["finished"] = None
    write_manifest(run_dir, manifest)
    return state


def _locked_run(run_dir: Path, resume: bool, arm_specs: list[ArmSpec], deploy_specs: list[Deploy], prompts,
                options: RunOptions, quiet: bool) -> str:
    plan = RunPlan(run_dir, arm_specs, deploy_specs, prompts, options)
    state = start_manifest(run_dir, manifest_for(plan), resume)
    if not quiet:
        click.echo(f"run directory: {plan.run_dir}", err=True)
    times = execute(plan, state)

    from harness.report import load_run, summarize_cells, terminal_table, write_reports

    run = load_run(plan.run_dir)  # read once, for the files and the printed tables
    cells = summarize_cells(run)
    write_reports(run, cells)
    return (terminal_table(run, cells)
            + f"\n\nwall time per stage: sim {times.sim_wall:.1f} s, TTS {times.tts:.1f} s, ASR {times.asr:.1f} s "
              f"({times.asr_transcribed} transcribed, {times.asr_cache_hits} cache hits)"
            + (f", {times.asr_wait:.1f} s waiting for Whisper at the end" if times.asr_wait >= 0.05 else "")
            + f"\nresults: {plan.run_dir}")


def _preflight(backend: str, arm_specs: list[ArmSpec], deploy_specs: list[Deploy], options: RunOptions,
               prompts: PromptSet | None = None) -> None:
    """Checks that need no run: a broken plugin arm, scheduler settings vLLM refuses, a real-backend
    arm that cannot be started, a reply the sim would mis-score, or a missing ASR model is refused
    before a run directory exists."""
    if backend == "sim":
        from harness.sim.scheduler import scheduler_config_for
        from harness.talkers import load_impl

        for arm in arm_specs:
            load_impl(arm)
        for deploy in deploy_specs:
            scheduler_config_for(deploy)
        if prompts is not None and options.sim_talker == DEFAULT_SIM_TALKER:
            check_sim_speaks(prompts)
    else:
        from harness.serve.backend import preflight_arm

        for arm in arm_specs:
            preflight_arm(arm, options.serve)
    if options.asr != "none":
        from harness.audio.asr import make_transcriber

        make_transcriber(options.asr, options.asr_model, options.beam_size)


def check_sim_speaks(prompts: PromptSet) -> None:
    """Each reply's words as the sim's Talker says them (``harness.tokenizer``) must score WER 0
    against the reply under Whisper's normaliser, else a correct arm is mis-scored (issue 24 case
    14). ``load_prompts`` already refuses the characters known to differ, naming each; this catches
    what only the normaliser's context shows (text in brackets it drops, ...). A reply that
    normalises to no words is left to the run: not measurable, recorded as such."""
    from harness.errors import short_repr
    from harness.scoring import spoken_mismatch
    from harness.tokenizer import is_spoken, tokenize

    for i, prompt in enumerate(prompts.prompts):
        spoken = " ".join(t for t in tokenize(prompt.reply) if is_spoken(t))
        if (bad := spoken_mismatch(prompt.reply, spoken)) is not None:
            ref, said = (_around(words, _first_difference(*(b.split() for b in bad))) for words in bad)
            raise ConfigError(f"{prompts.path}: prompts[{i}].reply: WER scoring reads {short_repr(ref)} where the sim "
                              f"says {short_repr(said)}, so a correct arm would not score 0 (prompt {prompt.id!r}); "
                              "rewrite the reply as plain words")


def _first_difference(a: list[str], b: list[str]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _around(text: str, k: int) -> str:
    """Words ``k - 2`` to ``k + 3`` of ``text``, with '...' where words are left out."""
    words = text.split()
    lo, hi = max(0, k - 2), min(len(words), k + 4)
    return ("... " if lo else "") + " ".join(words[lo:hi]) + (" ..." if hi < len(words) else "")
