"""Speech for the harness: espeak-ng TTS (the sim's Code2Wav), Whisper ASR, transcript cache.

Heavy libraries (faster-whisper, openai-whisper, torch) load only when first used.
"""

from harness.audio.asr import Transcriber, make_transcriber
from harness.audio.cache import TranscriptCache, sha256_file
from harness.audio.pipeline import AsrResult, transcribe_and_score
from harness.audio.tts import PAUSE, SAMPLE_RATE, speak, units_from_text

__all__ = ["PAUSE", "SAMPLE_RATE", "AsrResult", "Transcriber", "TranscriptCache", "make_transcriber",
           "sha256_file", "speak", "transcribe_and_score", "units_from_text"]
