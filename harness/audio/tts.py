"""Offline text-to-speech for the sim's Code2Wav: espeak-ng driven through ctypes.

Why espeak-ng from ``espeakng-loader``: it is a PyPI wheel that bundles libespeak-ng and its
voice data, so speech works offline after ``pip install`` with no Debian package. The PyPI
``espeakng`` binding would shell out to a system binary instead.

``speak`` is deterministic (same units give the same bytes), so a Talker that emits the same
words under two schedules produces identical WAVs, and the transcript cache answers the second.
Given an ``AudioCache`` it also skips espeak-ng for units it has spoken before (``speak_key``
names everything that shapes the samples), so a warm run synthesises nothing.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.metadata
import json
import os
import struct
import subprocess
import sys
import wave
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from harness.audio.cache import AudioCache
from harness.errors import UserError
from harness.physics import CODEC_FRAME_RATE_HZ, SPEAKING_RATE_WPM
from harness.speech_units import PAUSE, parse_babble

SAMPLE_RATE = 24_000  # Qwen2.5-Omni's Code2Wav rate; every WAV we write uses it
PAUSE_SECONDS = 0.25
EMPTY_SECONDS = 0.5  # what an empty unit list becomes: a short silent WAV
LEAD_SECONDS = 0.2  # silence before the first word: Whisper drops a word that starts at 0.0 s
# Bump when a change here alters the samples for the same units, voice and espeak-ng build
# (segmenting, resampling, WAV layout): old AudioCache entries then stop matching.
# 2: babble units are rendered as non-speech (voiced noise), no longer spoken as syllables.
TTS_CACHE_VERSION = 2

# Babble: what a codec decoder makes of codes that follow no text (docs/audio.md). Each babble
# unit (one per R noise frames) is one syllable-long burst of breathy voiced noise shaped by two
# vowel-like formants, lasting exactly its frames at the codec's 50 Hz: no phonetic sequence,
# so no words. Sources of the numbers:
BABBLE_F0_HZ = 120.0  # typical adult male speaking f0 (85-155 Hz), the range of the en-us voice
BABBLE_F0_JITTER = 0.05  # per-syllable f0 spread (+-5 %, a speaker's natural intonation range is wider)
BABBLE_F1_HZ = (300.0, 800.0)  # first-formant range of American English vowels (Peterson & Barney 1952)
BABBLE_F2_HZ = (850.0, 2300.0)  # second-formant range, same study
BABBLE_BANDWIDTHS_HZ = (100.0, 150.0)  # typical F1/F2 bandwidths of voiced speech (Fant 1960)
BABBLE_F2_GAIN = 0.5  # F2 about 6 dB below F1, the usual spectral tilt of voiced speech
BABBLE_VOICING = 0.5  # breathy phonation: aspiration noise as strong as the voiced part (Klatt & Klatt 1990)
BABBLE_PULSE_DECAY = 30.0  # glottal pulse decays to e^-30 within one period (a closed phase)
# Loudness: median RMS of 20 ms speech frames of this TTS voice, measured on the first four
# replies of prompts/default.yaml (2388 of 32768), so babble is as loud as speech.
BABBLE_RMS = 2400.0

# espeak_lib.h constants (espeak-ng 1.52)
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_EE_OK = 0
_PARAM = {"rate": 1, "volume": 2, "pitch": 3, "range": 4, "wordgap": 7}


@dataclass(frozen=True)
class Voice:
    """espeak-ng voice settings (tuned with bench/asr.py for Whisper round trips)."""

    name: str = "en-us"
    rate: int = SPEAKING_RATE_WPM  # words per minute (espeak's default is 175); R derives from it
    pitch: int = 50  # 0..100
    range: int = 50  # pitch range 0..100
    wordgap: int = 2  # extra gap between words, units of 10 ms
    volume: int = 100


DEFAULT_VOICE = Voice()

# The worker: a tiny stdlib-only program run as ``python -I -S -c _WORKER LIB DATA``. Why a
# fresh process per call: libespeak-ng keeps wave-generator state across syntheses (pitch
# flutter index, gain control, echo buffer), so in one process the same text gives different
# samples depending on what was spoken before. A new process starts from the same state every
# time, costs about 40 ms, and never shares espeak's global state between threads.
_WORKER = r"""
import ctypes, json, struct, sys
lib = ctypes.CDLL(sys.argv[1])
CB = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
chunks = []
def on_samples(wav, n, events):
    if n > 0 and wav:
        chunks.append(ctypes.string_at(wav, n * 2))
    return 0
callback = CB(on_samples)
lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
lib.espeak_SetSynthCallback.argtypes = [CB]
lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                             ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
req = json.loads(sys.stdin.buffer.read())
out = sys.stdout.buffer
rate = lib.espeak_Initialize(req["output"], 0, sys.argv[2].encode(), 0)
if rate <= 0:
    sys.stderr.write("espeak_Initialize failed\n"); sys.exit(3)
lib.espeak_SetSynthCallback(callback)
if lib.espeak_SetVoiceByName(req["voice"].encode()) != 0:
    sys.stderr.write("no voice " + repr(req["voice"]) + "\n"); sys.exit(4)
for key, value in req["params"]:
    lib.espeak_SetParameter(key, value, 0)
out.write(struct.pack("<i", rate))
for text in req["segments"]:
    del chunks[:]
    data = text.encode("utf-8") + b"\0"
    buf = ctypes.create_string_buffer(data, len(data))
    err = lib.espeak_Synth(buf, len(data), 0, req["position_type"], 0, req["flags"], None, None)
    lib.espeak_Synchronize()
    pcm = b"".join(chunks)
    out.write(struct.pack("<iq", err, len(pcm)))
    out.write(pcm)
out.flush()
"""

WORKER_TIMEOUT_S = 60.0  # bound on one synthesis call (espeak speaks ~85 s of audio per CPU second)


def _library_paths() -> tuple[str, str]:
    try:
        import espeakng_loader
    except ImportError:
        raise UserError("speech synthesis needs the 'espeakng-loader' package: pip install espeakng-loader") from None
    try:
        return espeakng_loader.get_library_path(), espeakng_loader.get_data_path()
    except RuntimeError as exc:
        raise UserError(f"espeakng-loader is broken: {exc}") from None


def espeak_segments(texts: Sequence[str], voice: Voice = DEFAULT_VOICE) -> tuple[int, list[np.ndarray]]:
    """Synthesise each text with espeak-ng in a fresh worker; returns (rate, int16 arrays)."""
    lib, data = _library_paths()
    request = {"voice": voice.name, "segments": list(texts), "output": _AUDIO_OUTPUT_SYNCHRONOUS,
               "position_type": _POS_CHARACTER, "flags": _CHARS_UTF8,
               "params": [[_PARAM[k], getattr(voice, k)] for k in ("rate", "pitch", "range", "wordgap", "volume")]}
    timeout = WORKER_TIMEOUT_S + sum(len(t) for t in texts) / 100.0
    try:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", _WORKER, lib, data],
                              input=json.dumps(request).encode(), capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise UserError(f"espeak-ng synthesis did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        detail = proc.stderr.decode(errors="replace").strip().splitlines()
        raise UserError(f"espeak-ng synthesis failed (exit {proc.returncode}): {detail[-1] if detail else 'no message'}")
    raw, pos = proc.stdout, 4
    (rate,) = struct.unpack_from("<i", raw, 0)
    arrays: list[np.ndarray] = []
    for _ in texts:
        err, size = struct.unpack_from("<iq", raw, pos)
        pos += 12
        if err != _EE_OK:
            raise UserError(f"espeak_Synth failed with code {err}")
        arrays.append(np.frombuffer(raw[pos:pos + size], dtype="<i2").copy())
        pos += size
    return rate, arrays


def resample_linear(samples: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Linear-interpolation resampling (upsampling 22050 -> 24000 needs no anti-alias filter)."""
    if src_rate == dst_rate or samples.size == 0:
        return samples.astype(np.float64)
    n_out = round(samples.size * dst_rate / src_rate)
    t = np.arange(n_out, dtype=np.float64) * (src_rate / dst_rate)
    return np.interp(t, np.arange(samples.size, dtype=np.float64), samples.astype(np.float64))


def units_from_text(text: str) -> list[str]:
    """The unit sequence a correctly conditioned Talker speaks for ``text``: its spoken tokens as
    words, every other token (punctuation, newline) as a pause. Used for references and tests."""
    from harness.tokenizer import is_spoken, tokenize

    return [tok if is_spoken(tok) else PAUSE for tok in tokenize(text)]


def _segments(units: Sequence[str]) -> list[str | None | tuple[int, int]]:
    """Group words into stretches spoken in one breath; ``None`` marks one pause, a tuple
    ``(code, frames)`` one babble unit."""
    out: list[str | None | tuple[int, int]] = []
    words: list[str] = []
    for unit in units:
        babble = parse_babble(unit)
        if unit == PAUSE or babble is not None:
            if words:
                out.append(" ".join(words))
                words = []
            out.append(babble)
        else:
            text = " ".join(unit.split())  # no control characters or newlines reach espeak
            if text:
                words.append(text)
    if words:
        out.append(" ".join(words))
    return out


def babble_samples(code: int, frames: int, index: int) -> np.ndarray:
    """int16 samples of one babble unit: ``frames`` codec frames (``frames / 50`` s) of breathy
    voiced noise under a one-syllable (Hann) envelope, with two formants. Deterministic in
    (code, frames, index): the same units always give the same bytes; ``index`` (the unit's place
    in the request) keeps consecutive units with the same code from being identical copies."""
    n = max(1, round(frames * SAMPLE_RATE / CODEC_FRAME_RATE_HZ))
    rng = np.random.default_rng([int(code), int(frames), int(index)])
    f1 = BABBLE_F1_HZ[0] + (BABBLE_F1_HZ[1] - BABBLE_F1_HZ[0]) * rng.random()
    f2 = BABBLE_F2_HZ[0] + (BABBLE_F2_HZ[1] - BABBLE_F2_HZ[0]) * rng.random()
    f0 = BABBLE_F0_HZ * (1.0 + BABBLE_F0_JITTER * rng.standard_normal())
    noise = rng.standard_normal(n)
    phase = (f0 * np.arange(n) / SAMPLE_RATE) % 1.0
    pulses = np.exp(-BABBLE_PULSE_DECAY * phase)  # one decaying glottal pulse per period
    pulses *= 1.0 / np.sqrt(np.mean(pulses ** 2))  # unit power, so BABBLE_VOICING is an energy share
    excitation = np.sqrt(BABBLE_VOICING) * noise * pulses + np.sqrt(1.0 - BABBLE_VOICING) * noise
    spectrum = np.fft.rfft(excitation)
    freqs = np.fft.rfftfreq(n, 1.0 / SAMPLE_RATE)
    shape = (1.0 / np.sqrt(1.0 + ((freqs - f1) / (BABBLE_BANDWIDTHS_HZ[0] / 2)) ** 2)
             + BABBLE_F2_GAIN / np.sqrt(1.0 + ((freqs - f2) / (BABBLE_BANDWIDTHS_HZ[1] / 2)) ** 2))
    envelope = np.hanning(n)
    y = np.fft.irfft(spectrum * shape, n) * envelope
    loud = y[envelope >= 0.5]  # the syllable's nucleus: as loud as this voice's speech frames
    rms = float(np.sqrt(np.mean(loud ** 2))) if loud.size else 0.0
    if rms > 0:
        y *= BABBLE_RMS / rms
    return np.clip(np.round(y), -32768, 32767).astype(np.int16)


def synthesize(units: Sequence[str], voice: Voice = DEFAULT_VOICE) -> np.ndarray:
    """int16 mono samples at 24 kHz for ``units`` (words, ``<pause>`` and babble units)."""
    parts: list[np.ndarray] = [np.zeros(round(LEAD_SECONDS * SAMPLE_RATE), dtype=np.int16)]
    pause = np.zeros(round(PAUSE_SECONDS * SAMPLE_RATE), dtype=np.int16)
    segments = _segments(units)
    texts = [seg for seg in segments if isinstance(seg, str)]
    rate, spoken = espeak_segments(texts, voice) if texts else (SAMPLE_RATE, [])
    it = iter(spoken)
    for index, seg in enumerate(segments):
        if seg is None:
            parts.append(pause)
            continue
        if isinstance(seg, tuple):
            parts.append(babble_samples(seg[0], seg[1], index))
            continue
        audio = resample_linear(next(it), rate, SAMPLE_RATE)
        parts.append(np.clip(np.round(audio), -32768, 32767).astype(np.int16))
    if not segments:  # no units at all: a short silent WAV, so every request has audio
        return np.zeros(round(EMPTY_SECONDS * SAMPLE_RATE), dtype=np.int16)
    return np.concatenate(parts)


def write_wav(samples: np.ndarray, wav_path: Path, rate: int = SAMPLE_RATE) -> None:
    """16-bit mono PCM WAV, written to a temporary name and renamed (no half-written files)."""
    wav_path = Path(wav_path)
    wav_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = wav_path.with_name(f".{wav_path.name}.{os.getpid()}.tmp")
    with wave.open(str(tmp), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    os.replace(tmp, wav_path)


@functools.lru_cache(maxsize=1)
def espeak_identity() -> tuple[tuple[str, str | int], ...]:
    """What identifies the espeak-ng build that speaks: its version (``espeak_Info``), the
    espeakng-loader release (which also ships the voice data) and the library's size. Where no
    version can be read, the library's mtime stands in for it. Computed once per process."""
    lib, _data = _library_paths()
    try:
        stat = os.stat(lib)
    except OSError as exc:
        raise UserError(f"espeak-ng library {lib}: {exc.strerror}") from None
    ident: dict[str, str | int] = {"library_bytes": stat.st_size}
    try:
        ident["loader"] = importlib.metadata.version("espeakng-loader")
    except importlib.metadata.PackageNotFoundError:
        pass
    version = _espeak_version(lib)
    if version:
        ident["espeak"] = version
    else:
        ident["library_mtime_ns"] = stat.st_mtime_ns
    return tuple(sorted(ident.items()))


def _espeak_version(lib: str) -> str | None:
    """``espeak_Info(NULL)``: only returns a static string, so loading the library here is safe
    (synthesis itself stays in the worker process)."""
    try:
        handle = ctypes.CDLL(lib)
        handle.espeak_Info.restype = ctypes.c_char_p
        handle.espeak_Info.argtypes = [ctypes.c_void_p]
        raw = handle.espeak_Info(None)
    except (OSError, AttributeError):
        return None
    return raw.decode("utf-8", "replace") if raw else None


def speak_key(units: Sequence[str], voice: Voice = DEFAULT_VOICE) -> str:
    """sha256 hex of a canonical JSON of everything that shapes ``speak``'s bytes: the units,
    the voice, the WAV rate, the silence lengths, the espeak-ng build and TTS_CACHE_VERSION."""
    payload = {
        "version": TTS_CACHE_VERSION,
        "units": [str(u) for u in units],
        "voice": asdict(voice),
        "sample_rate": SAMPLE_RATE,
        "lead_seconds": LEAD_SECONDS,
        "pause_seconds": PAUSE_SECONDS,
        "empty_seconds": EMPTY_SECONDS,
        "babble": [BABBLE_F0_HZ, BABBLE_F0_JITTER, BABBLE_F1_HZ, BABBLE_F2_HZ, BABBLE_BANDWIDTHS_HZ, BABBLE_F2_GAIN,
                   BABBLE_VOICING, BABBLE_PULSE_DECAY, BABBLE_RMS, CODEC_FRAME_RATE_HZ],
        "espeak": dict(espeak_identity()),
    }
    text = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def speak(units: Sequence[str], wav_path: Path, voice: Voice = DEFAULT_VOICE,
          cache: AudioCache | None = None) -> float:
    """Speak ``units`` into a 24 kHz mono 16-bit WAV at ``wav_path``; returns its seconds.

    Units are words, ``"<pause>"`` (0.25 s of silence) and babble units (``harness.sim.codec.
    babble_unit``: non-speech, ``frames / 50`` s each).
    No units gives 0.5 s of silence, so every request has a WAV to transcribe.
    With ``cache``, a hit places the cached WAV (the same bytes a synthesis would give) at
    ``wav_path`` without running espeak-ng; a miss synthesises and stores the result.
    """
    wav_path = Path(wav_path)
    key = speak_key(units, voice) if cache is not None else ""
    if cache is not None:
        seconds = cache.get(key, wav_path)
        if seconds is not None:
            return seconds
    samples = synthesize(units, voice)
    write_wav(samples, wav_path)
    if cache is not None:
        cache.put(key, wav_path)
    return samples.size / SAMPLE_RATE
