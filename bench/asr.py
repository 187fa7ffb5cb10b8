"""Round-trip benchmark: espeak-ng speaks the 16 replies, Whisper transcribes them, WER scores.

Why: the sim's clean audio must score near zero (mean WER <= 0.05) so that a stress WER near
1.0 is the Talker's fault, not the TTS's or the ASR's. This measures that per ASR model and beam
and the real-time factor (ASR seconds per audio second) on this machine.

    .venv/bin/python bench/asr.py                       # tiny.en and base, beam 1 and 5
    .venv/bin/python bench/asr.py --models base --beams 1 --rate 150 --wordgap 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.audio.asr import make_transcriber
from harness.audio.tts import DEFAULT_VOICE, Voice, speak, units_from_text
from harness.config import load_prompts
from harness.audio.scoring import normalize, wer

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="default")
    ap.add_argument("--models", default="tiny.en,base")
    ap.add_argument("--beams", default="1,5")
    ap.add_argument("--voice", default=DEFAULT_VOICE.name)
    ap.add_argument("--rate", type=int, default=DEFAULT_VOICE.rate)
    ap.add_argument("--pitch", type=int, default=DEFAULT_VOICE.pitch)
    ap.add_argument("--wordgap", type=int, default=DEFAULT_VOICE.wordgap)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "asr_results.json")
    ap.add_argument("--show", type=int, default=3, help="print the N worst transcripts per setting")
    args = ap.parse_args()

    voice = Voice(name=args.voice, rate=args.rate, pitch=args.pitch, wordgap=args.wordgap)
    prompts = load_prompts(args.prompts).prompts
    with tempfile.TemporaryDirectory(prefix="omni-stress-bench-") as tmp:
        wavs, audio_s = [], 0.0
        t0 = time.perf_counter()
        for p in prompts:
            wav = Path(tmp) / f"{p.id}.wav"
            audio_s += speak(units_from_text(p.reply), wav, voice=voice)
            wavs.append(wav)
        tts_s = time.perf_counter() - t0
        print(f"TTS: {len(wavs)} replies, {audio_s:.1f} s of audio in {tts_s:.2f} s wall "
              f"(voice {voice.name}, rate {voice.rate}, pitch {voice.pitch}, wordgap {voice.wordgap})")

        rows = []
        for model in args.models.split(","):
            shared = None
            for beam in (int(b) for b in args.beams.split(",")):
                tr = make_transcriber("faster-whisper", model, beam)
                load_s = None
                if shared is not None:  # same weights, load once per model
                    tr._model = shared  # type: ignore[attr-defined]
                else:
                    t_load = time.perf_counter()
                    shared = tr._load()  # type: ignore[attr-defined]
                    load_s = time.perf_counter() - t_load
                per, t0, c0 = [], time.perf_counter(), time.process_time()
                for p, wav in zip(prompts, wavs):
                    hyp = tr.transcribe(wav)
                    per.append({"id": p.id, "wer": wer(p.reply, hyp), "hypothesis": hyp})
                asr_s, cpu_s = time.perf_counter() - t0, time.process_time() - c0
                wers = [r["wer"] for r in per]
                row = {"model": model, "beam": beam, "mean_wer": statistics.fmean(wers), "max_wer": max(wers),
                       "over_half": sum(w > 0.5 for w in wers), "asr_seconds": asr_s, "audio_seconds": audio_s,
                       "rtf": asr_s / audio_s, "cpu_seconds": cpu_s, "cpu_rtf": cpu_s / audio_s, "load_seconds": load_s, "per_prompt": per}
                rows.append(row)
                print(f"{model:8s} beam {beam}: mean WER {row['mean_wer']:.3f}  max {row['max_wer']:.3f}  "
                      f"RTF {row['rtf']:.3f} (CPU {row['cpu_rtf']:.3f})")
                for r in sorted(per, key=lambda r: -r["wer"])[: args.show]:
                    if r["wer"] > 0:
                        ref = normalize(next(p.reply for p in prompts if p.id == r["id"]))
                        print(f"    {r['id']} {r['wer']:.3f}\n      ref: {ref}\n      hyp: {normalize(r['hypothesis'])}")

    print("\n| model | beam | mean WER | max WER | RTF (wall) | CPU s per audio s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['beam']} | {r['mean_wer']:.3f} | {r['max_wer']:.3f} | {r['rtf']:.3f} | {r['cpu_rtf']:.3f} |")
    result = {"voice": dataclasses.asdict(voice), "prompts": args.prompts, "n": len(prompts),
              "audio_seconds": audio_s, "tts_seconds": tts_s, "host": platform.platform(),
              "cpu_threads": 2, "load_average": os.getloadavg(), "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
