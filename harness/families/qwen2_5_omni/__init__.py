"""Qwen2.5-Omni: Thinker -> Talker -> Code2Wav; the Talker's ``talker_preprocess`` is under test.

What is specific to this family and where it lives:

* stage chain and the hook: below (``FAMILY``); the real server's stage 1 is the Talker;
* the contract's rows (``p < P``: the Thinker prompt rows, speaker + codec PAD, ``thinker_result[0]``
  + codec BOS; ``p >= P``: codec row + ``reply[k]``, text-EOS, then text-PAD forever):
  ``harness.families.qwen2_5_omni.contract`` (pure) and, as array arithmetic over the sim's row
  identities, ``harness.families.qwen2_5_omni.sim.SimContract``;
* the sim's cell (scripted Thinker, the ``words`` and ``speaking`` Talkers, the oracle transcript):
  ``harness.families.qwen2_5_omni.sim.build_cell``, over the Qwen2.5-Omni stand-in model
  (``harness.sim.model``), Thinker (``harness.sim.thinker``) and Talker rules
  (``harness.sim.talker``, ``harness.sim.speaking_talker``);
* arms: ``main`` / ``pr`` (``harness.talkers``, ``deploy_configs/arms.yaml``), upstream arms from the
  vendored 0.30.0 / 0.32.0rc1 files (``harness.talkers.upstream``);
* deploys ``reference``, ``stress``, ``specdec``, ``cpu-reference``, ``cpu-stress``; prompt sets
  ``default``, ``cpu_smoke``, ``long_inputs``: deploys and prompt sets without a ``family:`` key
  belong to this family (the default), so their files, hashes and records are the ones they were;
* the real server: chat completions with text and audio out, the Talker class the trace wraps.
"""

from __future__ import annotations

from harness.families import Family

FAMILY = Family(
    name="qwen2.5-omni",
    stages=("thinker", "talker", "code2wav"),
    stage_under_test=1,
    hook="talker_preprocess",
    trace_target="vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni:Qwen2_5OmniForConditionalGeneration",
    request_api="/v1/chat/completions",
    conform_model="qwen2.5-omni",
    default_arms=("main", "pr"),
    default_deploys=("reference", "stress"),
    default_prompts="default",
    sim_talkers=("words", "speaking"),
    sim_cell="harness.families.qwen2_5_omni.sim:build_cell",
    sim_check_prompts="harness.families.qwen2_5_omni.sim:check_prompts",
    speaking_rules="harness.speaking",
)
