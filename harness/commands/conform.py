"""``omni-stress conform``: does each stage model's real preprocess give every position the same row
under every schedule? Exit 0 every checked model conforms, 1 one does not, 2 could not check."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from harness.errors import UserError

_DEFAULT_SOURCE = "vllm-omni:0.30.0"


@click.command("conform")
@click.option("--model", "models", multiple=True, metavar="NAME",
              help="A model to check (repeatable): qwen2.5-omni, qwen3-omni, qwen3-tts, minicpmo-4.5 (real upstream code), or "
                   "the calibration arms qwen2.5-omni:main / qwen2.5-omni:pr, or MODEL:package.module:attr (a plugin arm: its "
                   "methods replace the release's hook). Default: the four upstream models.")
@click.option("--source", default=_DEFAULT_SOURCE, show_default=True, metavar="vllm-omni:SOURCE",
              help="Where the upstream code comes from: a checkout, a site-packages folder, a wheel, a version "
                   "(installed, cached, or the vendored 0.30.0) or 'installed' (docs/upstream-arm.md).")
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
def command(models: tuple[str, ...], source: str, deploys: tuple[str, ...], num_requests: int, generated: int,
            deploy_generated: int, fail_on: str, json_path: Path | None, html_path: Path | None) -> None:
    """Check each model's preprocess for schedule invariance: model x situation."""
    from harness.conform.check import DEFAULT_DEPLOYS, check_model
    from harness.conform.models import CALIBRATION, UPSTREAM_MODELS, resolve_model
    from harness.conform.report import Matrix, format_html, format_json, format_text
    from harness.config import load_deploy

    from harness.conform.models import MODELS

    unknown = [m for m in models if resolve_model(m) is None]
    if unknown:
        raise UserError(f"--model {unknown[0]}: unknown model; known: {', '.join(MODELS)}, or MODEL:package.module:attr "
                        f"(a plugin arm for {', '.join(UPSTREAM_MODELS)})")
    if not source.startswith("vllm-omni:"):
        raise UserError(f"--source {source}: give vllm-omni:SOURCE (a checkout, a wheel, a version or 'installed')")
    spec = source[len("vllm-omni:"):]
    names = tuple(dict.fromkeys(deploys)) if deploys else DEFAULT_DEPLOYS
    deploy_objs = tuple(load_deploy(d) for d in names if d != "none")
    selected = list(dict.fromkeys(models)) if models else list(UPSTREAM_MODELS)
    calibration = [m for m in CALIBRATION if m not in selected]
    logging.getLogger("vllm_omni").setLevel(logging.ERROR)  # upstream's warnings about missing GPU-side state

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    def run(name: str) -> list:
        out = []
        for runner in resolve_model(name)().runners:  # one row per model runner its deploys use
            say(f"[conform] {name} ({runner}) ...")
            out.append(check_model(resolve_model(name)(), spec, deploy_objs, requests=num_requests,
                                   forced_generated=generated, deploy_generated=deploy_generated,
                                   progress=lambda m: say(f"[conform]   {m}"), runner=runner))
        return out

    matrix = Matrix(source, tuple(d.name for d in deploy_objs), [r for n in selected for r in run(n)],
                    [r for n in calibration for r in run(n)],
                    {"requests": num_requests, "generated": generated, "deploy_generated": deploy_generated},
                    fail_on)
    click.echo(format_text(matrix), nl=False)
    for path, text in ((json_path, format_json(matrix) if json_path else None),
                       (html_path, format_html(matrix) if html_path else None)):
        if path is None or text is None:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise UserError(f"{path}: cannot write ({exc.strerror})") from None
        say(f"wrote {path}")
    sys.exit(matrix.exit_code)
