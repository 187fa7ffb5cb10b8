"""``omni-stress tiny-model DIR [--family F]``: build a tiny checkpoint for the real backend on CPU, by the
family's own builder (``Family.tiny_model_argv``: the speaking or random Qwen2.5-Omni, the speaking Qwen3-TTS, the
random Qwen3-Omni). Without ``--speaking``/``--random`` the family picks (speaking, except Qwen3-Omni: random).

Why a subprocess: the checkpoint's processor (Qwen2-VL image and video processors) needs the
transformers and torchvision of the real environment (``.venv-omni``), not of the sim's; the
builder runs with that environment's interpreter.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import click

from harness.errors import UserError
from harness.family import DEFAULT_FAMILY, family_names, get_family

BUILD_TIMEOUT_S = 900


@click.command("tiny-model")
@click.argument("out", type=click.Path(path_type=Path, file_okay=False))
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True,
              help="Seed of the random weights (the checkpoint is deterministic in it).")
@click.option("--speaking/--random", default=None,
              help="Speaking: Thinker and Talker weights built so the Talker says what its rows say "
                   "(docs/speaking-model.md); random: every weight random. Default: the family's (speaking).")
@click.option("--family", type=click.Choice(family_names()), default=DEFAULT_FAMILY, show_default=True,
              help="Which model family's tiny checkpoint (qwen3-tts: speaking only, docs/families/qwen3_tts.md; "
                   "qwen3-omni: speaking or random, docs/families/qwen3_omni.md).")
@click.option("--variant", default=None, metavar="NAME",
              help="A variant of the family's checkpoint (qwen3-tts: base, the Base model that takes a speaker "
                   "embedding instead of a CustomVoice speaker). Default: the family's own (CustomVoice).")
@click.option("--python", "python", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Interpreter of the real environment (default: --serve-python's default, ./.venv-omni/bin/python).")
def command(out: Path, seed: int, speaking: bool | None, family: str, variant: str | None,
            python: Path | None) -> None:
    """Build a tiny Qwen2.5-Omni (or, with --family, Qwen3-TTS or Qwen3-Omni) checkpoint in OUT, offline."""
    from harness.serve.backend import default_serve_python

    fam = get_family(family)
    if variant is not None and variant not in fam.tiny_variants:
        known = ", ".join(fam.tiny_variants) or "none"
        raise UserError(f"tiny-model --family {family}: --variant {variant!r}: unknown (variants: {known})")
    interpreter = str(python) if python else default_serve_python()
    if interpreter is None or not Path(interpreter).exists():
        raise UserError(f"tiny-model: no real environment interpreter ({interpreter or '.venv-omni/bin/python'}); "
                        "run scripts/install-real-cpu.sh or give --python")
    if out.exists() and any(out.iterdir()):
        raise UserError(f"tiny-model: {out} exists and is not empty (give a new folder)")
    argv = fam.tiny_model_argv(str(out), seed, speaking) + ([f"--{variant}"] if variant else [])
    try:
        proc = subprocess.run([interpreter, *argv],
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"tiny-model: the build did not finish in {BUILD_TIMEOUT_S} s") from None
    except OSError as exc:  # not executable, no shebang, a folder: not an interpreter (issue 33, case 6)
        raise UserError(f"tiny-model: --python {interpreter}: cannot run it ({exc.strerror or exc}); "
                        "give a Python interpreter, e.g. .venv-omni/bin/python") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise UserError(f"tiny-model: the build failed with {interpreter}: {tail[0]}")
    click.echo(proc.stdout.strip().splitlines()[-1])
