"""Issue 45, item 3, on a real ``vllm serve --omni`` on CPU: Qwen3-TTS's *Base* model, whose voice is a speaker
embedding (the API's ``speaker_embedding``; the release puts the vector in the speaker's row), with the speaking tiny
Base checkpoint (``omni-stress tiny-model --family qwen3-tts --variant base``) and four voices in turn
(``prompts/qwen3_tts_base_cpu_smoke.yaml``). The fix (``tts-fix``) and the fix that keeps the first request's voice
across requests (``tts-fix-voice-of-first``, ``tests/fixtures/tts_mutants.py``), one unpreempted cell each on the CPU
reference deploy: the worker's value comparison sees each later request's speaker row hold the first's vector. The
speaking sim runs the same cells; the two sides must agree.

Needs the real environment (``scripts/install-real-cpu.sh`` -> ``.venv-omni``); skipped without it, except under
``OMNI_STRESS_REQUIRE_REAL=1``, where its absence fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import load_prompts
from harness.families.qwen3_tts import speaking as sp

from conftest import build_tiny, records_by_cell, require_real_env, run_real

ROOT = Path(__file__).resolve().parents[1]
ARMS_FILE = ROOT / "tests" / "fixtures" / "arms_chunkers.yaml"
FIX, VOICE = "tts-fix", "tts-fix-voice-of-first"
REF = "qwen3-tts-cpu-reference"
PROMPTS = "qwen3_tts_base_cpu_smoke"
CELL_ARGS = ("--arms-file", str(ARMS_FILE), "--arm", FIX, "--arm", VOICE, "--deploy", REF, "--prompts", PROMPTS)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the real run, the speaking sim's run of the same cells)."""
    require_real_env()
    tmp = tmp_path_factory.mktemp("tts-base")
    model = build_tiny(tmp, "qwen3-tts", "tts base", variant="base")
    real = run_real(tmp, model, "qwen3-tts", "real", *CELL_ARGS, label="tts base", cwd=ROOT, timeout=1800)
    sim = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--family", "qwen3-tts", "--sim-talker",
                          "speaking", *CELL_ARGS, "--asr", "none", "--out", str(tmp), "--run-id", "sim",
                          "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert sim.returncode == 0, sim.stderr[-2000:]
    return real, tmp / "sim"


def test_every_base_request_is_answered_in_its_voice(runs: tuple[Path, Path]) -> None:
    real, _sim = runs
    texts = {p.id: p.reply for p in load_prompts(PROMPTS).prompts}
    cells = records_by_cell(real)
    assert sorted(cells) == [(FIX, REF), (VOICE, REF)]
    for cell, recs in cells.items():
        assert sorted(recs) == sorted(texts), cell
        for pid, r in recs.items():
            assert r.error is None and r.backend == "vllm-omni", (cell, pid, r.error)
            assert r.talker_prompt_len == sp.PROMPT_LEN and r.preemptions == 0, (cell, pid)
            # every voice says the same speech (the vector sits on a dim no weight reads)
            assert r.oracle_wer == 0.0 and len(r.codec_tokens) == 74, (cell, pid, r.oracle_transcript)


def test_the_fix_is_clean_and_a_voice_kept_across_requests_is_caught(runs: tuple[Path, Path]) -> None:
    """The fix: no misaligned position. ``VoiceOfFirstRequest``: whichever request's prompt is built first keeps its
    own voice; each of the three others has one misaligned position, its speaker row (P - 3) holding that vector."""
    real, _sim = runs
    cells = records_by_cell(real)
    for pid, r in cells[(FIX, REF)].items():
        assert (r.events.misaligned_text_positions, r.events.misaligned_end_positions) == (0, 0), pid
    counts = sorted((r.events.misaligned_text_positions, r.events.misaligned_end_positions)
                    for r in cells[(VOICE, REF)].values())
    assert counts == [(0, 0), (1, 0), (1, 0), (1, 0)]


def test_the_speaking_sim_says_what_the_real_server_says(runs: tuple[Path, Path]) -> None:
    real, sim = runs
    real_cells, sim_cells = records_by_cell(real), records_by_cell(sim)
    assert sorted(real_cells) == sorted(sim_cells)
    for cell, recs in real_cells.items():
        for pid, r in recs.items():
            s = sim_cells[cell][pid]
            assert s.codec_tokens == r.codec_tokens and s.oracle_transcript == r.oracle_transcript, (cell, pid)
        mis = [sorted(r.events.misaligned_text_positions for r in c[cell].values())
               for c in (real_cells, sim_cells)]
        assert mis[0] == mis[1], cell
    # the sim also names whose voice it was: the three later requests' one position each is the first request's
    assert sorted(r.events.cross_request_positions for r in sim_cells[(VOICE, REF)].values()) == [0, 1, 1, 1]
