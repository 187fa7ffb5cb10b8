"""``omni-stress conform``: does each stage model's real preprocess give every position the same row
under every schedule? Exit 0 every checked model conforms, 1 one does not, 2 could not check."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from harness.errors import UserError


def _finite_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    from harness.cli_options import finite_seconds

    return finite_seconds(ctx, param, value)


@click.command("conform")
@click.option("--model", "models", multiple=True, metavar="NAME",
              help="A model to check (repeatable): qwen2.5-omni, qwen3-omni, qwen3-tts, minicpmo-4.5, glm-tts, moss-tts, fish-speech, gepard (real upstream code), or "
                   "the calibration arms qwen2.5-omni:main / qwen2.5-omni:pr, or MODEL:package.module:attr (a plugin arm: its "
                   "methods replace the release's hook). Default: the eight upstream models.")
@click.option("--source", "sources", multiple=True, metavar="vllm-omni:SOURCE",
              help="A release to check (repeatable): vllm-omni:SOURCE (a checkout, a site-packages folder, a wheel, "
                   "a version, 'installed') or vllm-omni==VERSION. A version is the installed one, a cached wheel, "
                   "the vendored copy, or a pip download. Default: the vendored 0.30.0 and 0.32.0rc1.")
@click.option("--deploy", "deploys", multiple=True, metavar="NAME",
              help="Also run all requests through vLLM's scheduler under this deploy (repeatable; default "
                   "reference and stress; 'none' for forced schedules only).")
@click.option("--requests", "num_requests", type=click.IntRange(1, 16), default=4, show_default=True,
              help="Requests per model (the first prompts of prompts/default.yaml).")
@click.option("--generated", type=click.IntRange(16, 1900), default=40, show_default=True,
              help="Generated positions each forced schedule feeds.")
@click.option("--deploy-generated", type=click.IntRange(16, 1900), default=480, show_default=True,
              help="Generated positions per request in the vLLM runs (480 x 4 requests overflow stress's KV cache, "
                   "so it preempts).")
@click.option("--fail-on", "fail_on", type=click.Choice(["shipped", "any"]), default="shipped", show_default=True,
              help="Exit 1 for a failure a shipped deploy of the release reaches (shipped), or for every failure, "
                   "also one that needs changed settings (any).")
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None, help="Also write the matrix as JSON.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), default=None, help="Also write an HTML page.")
@click.option("--beside", "beside_dirs", type=click.Path(path_type=Path), multiple=True, metavar="RUN_DIR",
              help="Also print, per situation, the conform verdict beside what the run in RUN_DIR shows of it (spans "
                   "of that kind, misaligned ones, the worst request's WER and first wrong span), for the run's model "
                   "family's conform model. Repeatable: a sim run and a real one give conform | sim | real.")
@click.option("--strict", is_flag=True, help="Exit 2 when a --beside run is incomplete (killed, a torn last line), "
                                             "instead of a warning.")
@click.option("--arm-timeout", type=click.FloatRange(0, 86400), callback=_finite_seconds, default=10.0,
              show_default=True, help="Seconds one preprocess call may take before it fails its schedule (the cell "
                                      "says raised; 0: no limit).")
def command(models: tuple[str, ...], sources: tuple[str, ...], deploys: tuple[str, ...], num_requests: int, generated: int,
            deploy_generated: int, fail_on: str, json_path: Path | None, html_path: Path | None,
            beside_dirs: tuple[Path, ...], strict: bool, arm_timeout: float) -> None:
    """Check each model's preprocess for schedule invariance: model x situation."""
    from harness.conform.check import DEFAULT_DEPLOYS, check_model, modes_for
    from harness.conform.models import CALIBRATION, MODELS, UPSTREAM_MODELS, resolve_model
    from harness.talkers.release import DEFAULT_SOURCES, check_release, resolve, split_source
    from harness.conform.report import Matrix, Report, format_html, format_json, format_text
    from harness.config import load_deploy

    beside_runs = [_load_beside(d, strict) for d in dict.fromkeys(beside_dirs)]  # a bad run is refused first
    for d, (model, _run, _cells) in zip(dict.fromkeys(beside_dirs), beside_runs):
        if model != beside_runs[0][0]:
            raise UserError(f"--beside {d}: a run of conform model {model!r}, not {beside_runs[0][0]!r} like "
                            f"--beside {beside_dirs[0]} (put runs of one model family side by side)")
    if beside_runs and not models:
        models = (beside_runs[0][0],)  # the runs' family's model
    unknown = [m for m in models if resolve_model(m) is None]
    if unknown:
        raise UserError(f"--model {unknown[0]}: unknown model; known: {', '.join(MODELS)}, or MODEL:package.module:attr "
                        f"(a plugin arm for {', '.join(UPSTREAM_MODELS)})")
    sources = tuple(dict.fromkeys(sources)) or DEFAULT_SOURCES
    for source in sources:
        split_source(source)
    releases = [check_release(resolve(source)) for source in sources]  # a file that is no release: refused now
    names = tuple(dict.fromkeys(deploys)) if deploys else DEFAULT_DEPLOYS
    deploy_objs = tuple(load_deploy(d) for d in names if d != "none")
    selected = list(dict.fromkeys(models)) if models else list(UPSTREAM_MODELS)
    # each calibration arm checks the oracle on its own model's stand-in: run only those of the models checked
    checked = {m.split(":", 1)[0] for m in selected}
    calibration = [m for m in CALIBRATION if m not in selected and m.split(":", 1)[0] in checked]
    logging.getLogger("vllm_omni").setLevel(logging.ERROR)  # upstream's warnings about missing GPU-side state
    import torch

    from harness.sim import armcall

    armcall.set_limit(arm_timeout)  # every preprocess call is fenced: a hang or a KeyboardInterrupt fails its schedule

    # the check's tensors are a few rows wide: one thread is fastest (on 2 busy cores a 2-thread matmul of
    # 80 x 48 took 15 ms against 0.02 ms on one), and it keeps the rows bit-identical between runs
    torch.set_num_threads(1)

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    def run(name: str, spec: str) -> list:
        out = []
        for runner, async_chunk in modes_for(resolve_model(name)(), spec):  # one row per mode its deploys use
            say(f"[conform] {name} ({runner}{', async_chunk' if async_chunk else ''}) ...")
            out.append(check_model(resolve_model(name)(), spec, deploy_objs, requests=num_requests,
                                   forced_generated=generated, deploy_generated=deploy_generated,
                                   progress=lambda m: say(f"[conform]   {m}"), runner=runner,
                                   async_chunk=async_chunk))
        return out

    matrices = []
    for i, (source, release) in enumerate(zip(sources, releases)):
        say(f"[conform] {source}: {release.label}")
        matrices.append(Matrix(f"{source} = {release.label}", tuple(d.name for d in deploy_objs),
                               [r for n in selected for r in run(n, release.spec)],
                               [r for n in calibration for r in run(n, release.spec)] if i == 0 else [],
                               {"requests": num_requests, "generated": generated, "deploy_generated": deploy_generated},
                               fail_on))
    report = Report(matrices)
    click.echo(format_text(report), nl=False)
    if beside_runs:
        click.echo(_beside(report, beside_runs), nl=False)
    for path, text in ((json_path, format_json(report) if json_path else None),
                       (html_path, format_html(report) if html_path else None)):
        if path is None or text is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{path}: cannot write ({exc.strerror})") from None
        say(f"wrote {path}")
    sys.exit(report.exit_code)


def _load_beside(run_dir: Path, strict: bool = False) -> tuple[str, Any, list[tuple[str, str, str]]]:
    """(the run's family's conform model, the run, its (arm, deploy, runner) cells) of ``--beside RUN_DIR``;
    an incomplete run is said as ``report``, ``compare`` and ``fidelity`` say it (refused with ``--strict``)."""
    from harness.config import load_deploy
    from harness.errors import ConfigError
    from harness.family import get_family
    from harness.report import summary
    from harness.rundir import manifest_family

    run = summary.load_run(run_dir)
    warning = summary.incomplete_warning(run, strict, "not put beside (--strict)")
    if warning:
        click.echo(warning, err=True)
    family = get_family(manifest_family(run.manifest), f"{run_dir}/manifest.json: family")
    cells: list[tuple[str, str, str]] = []
    for arm, deploy in dict.fromkeys((r.arm, r.deploy) for r in run.requests):
        try:  # the shipped deploy of that name: its runner, and its Thinker-to-Talker path
            d = load_deploy(deploy)
            runner = d.talker.model_runner + ("+async" if d.async_chunk else "")
        except ConfigError:
            runner = "v1"  # a deploy file not at hand: vLLM-Omni's default runner off CUDA
        cells.append((arm, deploy, runner))
    return family.conform_model, run, cells


def _beside(report: Any, runs: list[tuple[str, Any, list[tuple[str, str, str]]]]) -> str:
    from harness.backends import is_simulated
    from harness.conform.beside import BesideRun, beside_table
    from harness.report.summary import cell_releases
    from harness.spanstore import read_spans

    model = runs[0][0]
    beside = []
    for _model, run, cells in runs:
        spans = [dict(s.__dict__) for s in read_spans(run.run_dir)]
        wer = {(r.arm, r.deploy, r.prompt_id): r.wer if r.wer is not None else r.oracle_wer for r in run.requests}
        simulated = all(is_simulated(r.backend) for r in run.requests)
        beside.append(BesideRun("sim" if simulated else "real", cells, spans, wer, cell_releases(run)))
    data = report.to_json()
    where = ", ".join(str(run.run_dir) for _m, run, _c in runs)
    out = []
    for matrix in data.get("releases", [data]):
        out.append(f"\nconform beside run{'s' if len(runs) > 1 else ''} {where} ({matrix['source']}):\n\n"
                   + beside_table(matrix, model, beside))
    return "".join(out)
