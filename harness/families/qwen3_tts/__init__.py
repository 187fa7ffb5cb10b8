"""Qwen3-TTS: Talker (with its code predictor) -> Code2Wav; the Talker's ``preprocess`` is under test.

No Thinker: the input is the text (plus a speaker). What is specific to this family and where it lives:

* the contract's rows (``p < P``: the release's prompt builder's rows in the streaming-text layout;
  ``p >= P``: the position's codec row + ``trailing_text[p - P]``, then ``tts_pad``):
  ``harness.families.qwen3_tts.contract`` (pure) and ``harness.families.qwen3_tts.sim.TTSContract``;
* the sim's cell, stand-in model, runner path (the batched decode hook and the MTP text row; V1 or
  MRV2 on a preemption, by the deploy's ``talker.model_runner``) and the Talker's start rows:
  ``harness.families.qwen3_tts.sim``;
* arms: the release's own hooks (``tts-0.30.0``, ``tts-0.32.0rc1``, any ``vllm-omni:SOURCE``), the fix
  (``tts-fix``, ``harness.families.qwen3_tts.fix``), plugins over the release
  (``harness.families.qwen3_tts.arms``);
* deploys ``qwen3-tts-reference``, ``qwen3-tts-stress`` (V1) and their ``-mrv2`` twins; prompt set
  ``qwen3_tts``.

The real server (``--backend vllm-omni``, V1 runner): ``harness.families.qwen3_tts.serve`` (its deploy YAML,
``/v1/audio/speech`` requests, the worker's trace and contract check of ``preprocess`` and
``preprocess_decode_batch``); the speaking tiny checkpoint: ``speaking`` (rules), ``speaking_model``
(weights), ``tiny_model`` (the build), ``speaking_check`` (its self-check), on ``harness.speaking``'s shared
pieces.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from harness.errors import UserError
from harness.families.qwen3_tts.contract import SPEAKERS
from harness.family import Family
from harness.speaking.rules import blind_spots


class Qwen3TTS(Family):
    name = "qwen3-tts"
    stages = ("talker", "code2wav")
    stage_under_test = 0
    hook = "preprocess"
    trace_target = "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker:Qwen3TTSTalkerForConditionalGeneration"
    request_api = "/v1/audio/speech"
    conform_model = "qwen3-tts"
    default_arms = ("tts-0.30.0", "tts-fix")
    default_deploys = ("qwen3-tts-reference", "qwen3-tts-stress", "qwen3-tts-mrv2-reference", "qwen3-tts-mrv2-stress")
    default_prompts = "qwen3_tts"
    sim_talkers = ("words", "speaking")
    text_input = True
    # what the speaking Talker (``speaking``) cannot hear: only the misaligned columns count wrong rows there
    speaking_blind_spots = blind_spots(tag_bits=3, span="text", eos="tts_eos", pad="tts_pad",
                                       elsewhere="the role header and tts_pad rows before P-2")
    gate_rules = "gates-qwen3-tts"
    serve_missing = None
    speakers = SPEAKERS
    speaker_embeddings = True
    tiny_variants = ("base",)  # the Base checkpoint (speaker embeddings, no CustomVoice speakers)

    def sim_cell(self, impl: Any, deploy: Any, prompts: Any, seed: int, talker_mode: str) -> Any:
        from harness.families.qwen3_tts.sim import build_cell

        return build_cell(impl, deploy, prompts, seed, talker_mode)

    def check_prompts(self, prompts: Any, talker_mode: str) -> None:
        from harness.families.qwen3_tts.sim import check_prompts

        check_prompts(prompts, talker_mode)

    def talker_prompt_lens(self, prompts: Any) -> list[int]:
        """The streaming-text layout's prompt: 9 rows for every text (``harness.families.qwen3_tts.contract``)."""
        from harness.families.qwen3_tts.contract import PROMPT_LEN

        return [PROMPT_LEN] * len(prompts.prompts)

    def load_arm(self, arm: Any) -> Any:
        from harness.families.qwen3_tts.arms import load_arm

        return load_arm(arm)

    def speaking_rules(self) -> ModuleType:
        from harness.families.qwen3_tts import speaking

        return speaking

    def serve(self) -> ModuleType:
        from harness.families.qwen3_tts import serve

        return serve

    def tiny_model_argv(self, out: str, seed: int, speaking: bool | None) -> list[str]:
        if speaking is False:
            raise UserError("tiny-model --family qwen3-tts: only the speaking checkpoint is built (drop --random)")
        return ["-m", "harness.families.qwen3_tts.tiny_model", out, "--seed", str(seed)]


FAMILY = Qwen3TTS()
