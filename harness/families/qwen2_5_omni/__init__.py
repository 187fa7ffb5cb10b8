"""Qwen2.5-Omni: Thinker -> Talker -> Code2Wav; the Talker's ``talker_preprocess`` is under test.

Everything specific to this family lives in this package:

* the contract's rows (``p < P``: the Thinker prompt rows, speaker + codec PAD, ``thinker_result[0]``
  + codec BOS; ``p >= P``: codec row + ``reply[k]``, text-EOS, then text-PAD forever): ``contract``
  (pure) and, as array arithmetic over the sim's row identities, ``sim.SimContract``;
* the sim's cell (``sim``): the scripted Thinker (``thinker``), the stand-in model the arm is bound
  onto (``model``), the ``words`` and ``speaking`` Talkers (``harness.sim.talker``,
  ``harness.sim.speaking_talker`` with this family's ``speaking`` rules), the oracle transcript;
* arms (``arms``): ``main`` / ``pr`` (``main``, ``pr``, their shared upstream helpers ``helpers``),
  plugins, and upstream arms from the vendored 0.30.0 / 0.32.0rc1 files;
* the real server (``serve``): chat completions with text and audio out, the Talker class the trace
  wraps; the speaking tiny checkpoint: ``speaking`` (rules), ``speaking_model`` (weights),
  ``tiny_model`` (the build), ``speaking_check`` (its self-check), on ``harness.speaking``'s shared pieces;
* deploys ``reference``, ``stress``, ``specdec``, ``cpu-reference``, ``cpu-stress``; prompt sets
  ``default``, ``cpu_smoke``, ``long_inputs``: deploys and prompt sets without a ``family:`` key
  belong to this family (the default), so their files, hashes and records are the ones they were.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from harness.family import Family
from harness.speaking.rules import blind_spots


class Qwen25Omni(Family):
    name = "qwen2.5-omni"
    stages = ("thinker", "talker", "code2wav")
    stage_under_test = 1
    hook = "talker_preprocess"
    trace_target = "vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni:Qwen2_5OmniForConditionalGeneration"
    request_api = "/v1/chat/completions"
    conform_model = "qwen2.5-omni"
    default_arms = ("main", "pr")
    default_deploys = ("reference", "stress")
    default_prompts = "default"
    sim_talkers = ("words", "speaking")
    text_input = False
    # what the speaking Talker (``speaking``) cannot hear: wrong rows there change nothing it says, so only
    # the misaligned columns count them (docs/speaking-model.md, "What only the contract check sees")
    speaking_blind_spots = blind_spots(tag_bits=5, span="reply", eos="text-EOS", pad="text-PAD",
                                       elsewhere="Thinker prompt rows before P-2, which speaker row")
    gate_rules = "gates"
    serve_missing = None

    def sim_cell(self, impl: Any, deploy: Any, prompts: Any, seed: int, talker_mode: str) -> Any:
        from harness.families.qwen2_5_omni.sim import build_cell

        return build_cell(impl, deploy, prompts, seed, talker_mode)

    def check_prompts(self, prompts: Any, talker_mode: str) -> None:
        from harness.families.qwen2_5_omni.sim import check_prompts

        check_prompts(prompts, talker_mode)

    def talker_prompt_lens(self, prompts: Any) -> list[int]:
        """``thinker2talker_token_only``'s placeholder: the Thinker prompt's tokens plus START and END."""
        from harness.tokenizer import tokenize

        return [len(tokenize(p.thinker_prompt(prompts.system_prompt))) + 2 for p in prompts.prompts]

    def load_arm(self, arm: Any) -> Any:
        from harness.families.qwen2_5_omni.arms import load_arm

        return load_arm(arm)

    def speaking_rules(self) -> ModuleType:
        from harness.families.qwen2_5_omni import speaking

        return speaking

    def serve(self) -> ModuleType:
        from harness.families.qwen2_5_omni import serve

        return serve

    def tiny_model_argv(self, out: str, seed: int, speaking: bool | None) -> list[str]:
        return ["-m", "harness.families.qwen2_5_omni.tiny_model", out, "--seed", str(seed),
                *(["--speaking"] if speaking is not False else [])]


FAMILY = Qwen25Omni()
