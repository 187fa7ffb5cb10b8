"""``omni-stress transcribe FILE.wav...``: Whisper on any WAV, with WER against a reference.

Why: to check one request's audio by hand (a run's ``audio/*.wav``) with exactly the ASR
settings and transcript cache that ``run`` uses.
"""

from __future__ import annotations

from pathlib import Path

import click

from harness.audio.asr import BACKENDS, make_transcriber
from harness.audio.cache import TranscriptCache, default_transcript_dir
from harness.audio.pipeline import transcribe_and_score
from harness.errors import UserError
from harness.audio.scoring import summarize


@click.command("transcribe")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--reference", default=None, metavar="TEXT", help="Expected text; prints the WER of each file.")
@click.option("--asr", "backend", type=click.Choice(list(BACKENDS)), default="faster-whisper", show_default=True,
              help="ASR backend.")
@click.option("--asr-model", default="base", show_default=True, metavar="tiny.en|base|PATH",
              help="Whisper model: a packaged name, a CTranslate2 folder (faster-whisper) or a .pt file (openai-whisper).")
@click.option("--beam-size", type=int, default=1, show_default=True, help="Beam size (1 = greedy).")
@click.option("--no-cache", is_flag=True, help="Do not read or write the on-disk transcript cache.")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help=f"Transcript cache folder [default: {default_transcript_dir()}].")
def command(files: tuple[Path, ...], reference: str | None, backend: str, asr_model: str, beam_size: int,
            no_cache: bool, cache_dir: Path | None) -> None:
    """Transcribe FILES (WAV) with Whisper; with --reference also score them (WER)."""
    for f in files:  # every file is checked before the model loads: a bad one is one line, at once
        _check_audio(f)
    transcriber = make_transcriber(backend, asr_model, beam_size)
    cache = TranscriptCache(None if no_cache else (cache_dir or default_transcript_dir()))
    wers = []
    for f in files:
        try:
            result = transcribe_and_score(f, reference or "", transcriber, cache)
        except Exception as exc:
            if not _is_decode_error(exc):
                raise
            raise UserError(f"{f}: cannot decode the audio ({_decode_text(exc)})") from None
        tag = " (cached)" if result.cached else ""
        if reference is None:
            click.echo(f"{f}{tag}: {result.transcript}")
        else:
            wers.append(result.wer)
            click.echo(f"{f}{tag}: WER {result.wer:.3f}: {result.transcript}")
    if reference is not None and len(wers) > 1:
        s = summarize(wers)
        click.echo(f"{s.n} files: mean WER {s.mean:.3f}, median {s.median:.3f}, {s.over_half} over 0.5")


def _check_audio(path: Path) -> None:
    """An audio file PyAV (the decoder both ASR backends use) can open, with an audio stream."""
    if not path.is_file():
        raise UserError(f"{path}: audio file not found")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if size == 0:
        raise UserError(f"{path}: empty file (0 bytes), not audio")
    try:
        import av
    except ImportError:  # the decoder is checked when the model loads
        return
    try:
        with av.open(str(path)) as container:
            if not container.streams.audio:
                raise UserError(f"{path}: no audio stream in the file (expected a WAV)")
    except UserError:
        raise
    except Exception as exc:
        if not _is_decode_error(exc):
            raise
        raise UserError(f"{path}: not an audio file PyAV can decode, expected a WAV ({_decode_text(exc)})") from None


def _is_decode_error(exc: BaseException) -> bool:
    """PyAV's errors (``av.error.*``, e.g. InvalidDataError), and a file that vanished or cannot be read."""
    return type(exc).__module__.startswith("av") or isinstance(exc, (OSError, EOFError))


def _decode_text(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc)
    return f"{type(exc).__name__}: {' '.join(str(text).split())}"
