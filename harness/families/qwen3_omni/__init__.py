"""Qwen3-Omni: Thinker -> Talker -> Code2Wav; the Talker's ``talker_preprocess`` is under test.

vLLM-Omni's flagship omni model. What is specific to this family and where it lives:

* the contract's rows (the user turn's and assistant header's projected Thinker rows, the Qwen3
  assistant block, then ``r_{k+1}`` / ``tts_eos`` / ``tts_pad`` on the position's codec row):
  ``harness.families.qwen3_omni.contract`` (pure) and ``harness.families.qwen3_omni.sim.OmniContract``;
* the sim's cell (``sim``): the scripted Thinker and both Thinker-to-Talker paths (``async_chunk: true``,
  chunk 0 then one streamed row per Thinker step; ``false``, the full payload), the stand-in model,
  the runner path (``talker_mtp``'s text step), in a bf16-exact row space (``rows``);
* arms (``arms``): the release's own hook (``omni3-0.30.0``, ``omni3-0.32.0rc1``), the fix
  (``omni3-fix``, ``fix``), plugins over the release;
* deploys ``qwen3-omni-{reference,stress}`` (async), ``qwen3-omni-full-{reference,stress}`` (full
  payload), ``qwen3-omni-full-mrv2-{reference,stress}``; prompt set ``qwen3_omni``; gate rules
  ``gates-qwen3-omni``.

* a tiny checkpoint (``tiny_model``, ``omni-stress tiny-model DIR --family qwen3-omni [--speaking]``) that
  0.30.0's unmodified Qwen3-Omni serves on CPU; ``--speaking`` (``speaking``, ``speaking_model``,
  ``speaking_check``): the Thinker's embedding table and the Talker built so the Talker says the forced reply.

* the real server (``serve``, ``--backend vllm-omni``): the release's deploy YAML with the deploy's Talker
  settings, the chat path with the reply forcer, the trace at ``talker_preprocess`` and at the connector;
  CPU deploys ``qwen3-omni-cpu-{reference,stress}`` (streaming) and ``qwen3-omni-cpu-full-{reference,stress}``,
  prompt set ``qwen3_omni_cpu``.

* the sim's ``speaking`` Talker (``sim._speaking_cell``): the tiny checkpoint's tokenizer and rules, so
  ``omni-stress fidelity`` compares codec streams request by request with the real server.

Not here yet: the worker's contract check for this family's rows (the real server traces at ``spans``).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from harness.family import Family
from harness.speaking.rules import blind_spots

# the default tiny checkpoint: the speaking one (0.30.0 on CPU said the forced reply, both Thinker-to-Talker paths:
# docs/families/qwen3_omni.md)
DEFAULT_SPEAKING = True



class Qwen3Omni(Family):
    name = "qwen3-omni"
    stages = ("thinker", "talker", "code2wav")
    stage_under_test = 1
    hook = "talker_preprocess"
    trace_target = "vllm_omni.model_executor.models.qwen3_omni.qwen3_omni:Qwen3OmniMoeForConditionalGeneration"
    request_api = "/v1/chat/completions"
    conform_model = "qwen3-omni"
    default_arms = ("omni3-0.30.0", "omni3-fix")
    default_deploys = ("qwen3-omni-reference", "qwen3-omni-stress", "qwen3-omni-full-reference",
                       "qwen3-omni-full-stress")
    default_prompts = "qwen3_omni"
    sim_talkers = ("words", "speaking")
    text_input = False
    # what the speaking Talker (``speaking``) cannot hear: only the misaligned columns count wrong rows there
    speaking_blind_spots = blind_spots(tag_bits=2, span="reply", eos="tts_eos", pad="tts_pad",
                                       elsewhere="the user turn, the assistant header and tts_pad rows before P-2")
    gate_rules = "gates-qwen3-omni"
    serve_missing = None

    def sim_cell(self, impl: Any, deploy: Any, prompts: Any, seed: int, talker_mode: str) -> Any:
        from harness.families.qwen3_omni.sim import build_cell

        return build_cell(impl, deploy, prompts, seed, talker_mode)

    def check_prompts(self, prompts: Any, talker_mode: str) -> None:
        from harness.families.qwen3_omni.sim import check_prompts

        check_prompts(prompts, talker_mode)

    def talker_prompt_lens(self, prompts: Any) -> list[int]:
        """The user turn plus the nine assistant rows (``_compute_talker_prompt_ids_length``)."""
        from harness.families.qwen3_omni.contract import prompt_len, user_turn_len

        return [prompt_len(user_turn_len(p.user)) for p in prompts.prompts]

    def load_arm(self, arm: Any) -> Any:
        from harness.families.qwen3_omni.arms import load_arm

        return load_arm(arm)

    def speaking_rules(self) -> ModuleType:
        """The speaking tiny checkpoint's rules (``harness.families.qwen3_omni.speaking``)."""
        from harness.families.qwen3_omni import speaking

        return speaking

    def serve(self) -> ModuleType:
        from harness.families.qwen3_omni import serve

        return serve

    def tiny_model_argv(self, out: str, seed: int, speaking: bool | None) -> list[str]:
        """The tiny checkpoint (``harness.families.qwen3_omni.tiny_model``): speaking with ``--speaking``
        (``speaking_model``), random with ``--random``; neither: :data:`DEFAULT_SPEAKING`."""
        if speaking is None:
            speaking = DEFAULT_SPEAKING
        return ["-m", "harness.families.qwen3_omni.tiny_model", out, "--seed", str(seed),
                *(["--speaking"] if speaking else [])]


FAMILY = Qwen3Omni()
