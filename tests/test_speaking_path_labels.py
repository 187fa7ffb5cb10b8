"""Issue 32, item 5: the oracle's label says what the oracle is on each backend, the speaking
checkpoint's reply is checked against the prompt set's, and a sweep axis the sim cannot honour
(`sampling.seed`) is refused in one line."""

from __future__ import annotations

from pathlib import Path

from conftest import REPO, invoke_cli
from harness.family import get_family
from harness.report.tables import oracle_origin, wer_source_note
from harness.serve.backend import reply_mismatch

SPEAKING_BLIND_SPOTS = get_family("qwen2.5-omni").speaking_blind_spots


class _Run:
    def __init__(self, *backends: str, sim_talker: str | None = None) -> None:
        self.requests = [type("R", (), {"backend": b})() for b in backends]
        self.manifest = {"backend": backends[0], "asr": None, **({"sim_talker": sim_talker} if sim_talker else {})}


class _Cell:
    wer_source, not_measurable = "oracle", 0


def test_the_oracle_label_names_the_backend_that_made_it():
    assert oracle_origin(_Run("sim", "sim")) == "the sim's spoken word sequence before TTS"
    assert oracle_origin(_Run("vllm-omni")) == (
        "the real Talker's codec stream read back through the speaking checkpoint's table")
    assert oracle_origin(_Run("sim", "vllm-omni")).count(";") == 1


def test_a_thinker_that_did_not_say_the_reply_is_named():
    assert reply_mismatch("p1", "Go to bed.", "Go to bed.\n") is None
    assert reply_mismatch("p1", None, "anything") is None  # no scripted reply: nothing to compare
    assert reply_mismatch("p1", "Go to bed.", "You asked: sleep") == (
        "prompt 'p1': the Thinker said 'You asked: sleep', not the prompt set's reply 'Go to bed.' "
        "(the speaking checkpoint's reply forcer did not hold; not scored)")


def test_a_sampling_seed_axis_is_refused_on_the_sim(tmp_path: Path):
    sweep = tmp_path / "seeds.yaml"
    sweep.write_text("name: seeds\nbase: stress\nreference: reference\naxes:\n  sampling.seed: [1, 2]\n")
    res = invoke_cli("sweep", str(sweep), "--prompts", str(REPO / "tests" / "data" / "prompts_e2e.yaml"),
                     "--out", str(tmp_path / "out"))
    assert res.exit_code == 2
    assert res.stderr.strip().splitlines() == [
        f"omni-stress: error: {sweep}: axes.sampling.seed: the sim's Talker samples with the run's seed (--seed; "
        "repeat r uses seed + r - 1), not the deploy's sampling.seed; sweep seeds with --seed and --repeat (on the "
        "real backend the axis reaches the server)"]
    assert not (tmp_path / "out").exists()


def test_the_oracle_note_lists_what_the_speaking_talker_cannot_hear():
    """Issue 32, item 4: where the oracle comes from the speaking Talker (real backend, or the sim with
    --sim-talker speaking) the note under the seed table says which wrong rows only the misaligned
    columns count; the default words sim's note is unchanged."""
    words = "WER source: oracle transcript (the sim's spoken word sequence before TTS; no ASR ran)"
    assert wer_source_note(_Run("sim"), [_Cell()]) == words
    assert wer_source_note(_Run("sim", sim_talker="speaking"), [_Cell()]) == (
        words + "; " + SPEAKING_BLIND_SPOTS)
    assert wer_source_note(_Run("vllm-omni"), [_Cell()]) == (
        "WER source: oracle transcript (the real Talker's codec stream read back through the speaking "
        "checkpoint's table; no ASR ran); " + SPEAKING_BLIND_SPOTS)
    assert SPEAKING_BLIND_SPOTS.startswith("the speaking Talker hears only whether a codec-BOS row exists")
