"""Qwen2.5-Omni's talker (stage 1): the calibration of the conformance check.

* ``qwen2.5-omni``: the real upstream ``Qwen2_5OmniForConditionalGeneration.talker_preprocess``
  from ``--source`` (``vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py``).
* ``qwen2.5-omni:main`` / ``qwen2.5-omni:pr``: the built-in arms (``harness.families.qwen2_5_omni.main``, the
  0.30.0 behaviour; ``harness.families.qwen2_5_omni.pr``, the fix). ``main`` must fail and ``pr`` conform,
  or the check itself is broken.

Stand-in and payload: the sim's own (``harness.families.qwen2_5_omni.model.SimTalkerModelBase`` and the sim
Thinker's ``thinker2talker_full_payload``-shaped payload, ``harness.families.qwen2_5_omni.thinker``), so these rows
are exactly the ones ``omni-stress run`` feeds. Hook: ``talker_preprocess``, no MTP path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from harness.conform.adapter import Adapter, ConformRequest, Provenance, fixed_tokens
from harness.conform.reach import ModelDeploys
from harness.talkers.upstream import CLASS_NAME, MEMBER, MODULE_NAME

SEED = 42


class Qwen25OmniAdapter(Adapter):
    class_name = CLASS_NAME
    member = MEMBER
    module_name = MODULE_NAME
    entries = ("talker_preprocess",)
    codec_vocab = 2048
    notes = ("stand-in: the sim's SimTalkerModelBase (codec table, special text/codec rows, talker_config ids, "
             "the model-level thinker_reply_part pool, zeros after a 32-token profile run); payload: the sim "
             "Thinker's embed.prefill / hidden_states.output / ids for the first prompts of prompts/default.yaml")

    # the Talker is stage 1; its max_model_len is the model config's 32768 (the deploy sets none)
    deploys = ModelDeploys(("qwen2_5_omni.yaml", "qwen2_5_omni*.yaml"), stage=1, max_model_len=32768)

    def __init__(self, arm: str = "upstream", plugin: str | None = None) -> None:
        self.arm = arm
        self.upstream = arm == "upstream"
        self.plugin_target = plugin
        self.name = "qwen2.5-omni" if self.upstream else f"qwen2.5-omni:{plugin or arm}"
        self.title = {"upstream": "Qwen2.5-Omni talker (upstream)", "main": "Qwen2.5-Omni, built-in arm main",
                      "pr": "Qwen2.5-Omni, built-in arm pr", "plugin": f"Qwen2.5-Omni, plugin arm {plugin}"}[arm]

    def stand_in_class(self) -> type:
        from harness.families.qwen2_5_omni.model import SimTalkerModelBase

        return SimTalkerModelBase

    def load(self, spec: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> tuple[Any, Provenance]:
        if self.upstream:
            return super().load(spec, base_dir, wheel_dir)
        from harness.config import ArmSpec, load_arms
        from harness.talkers import load_impl

        # a plugin arm loads as `omni-stress run --arm NAME=package.module:attr` loads it (a class with
        # talker_preprocess or a function), and runs on the sim's stand-in like main and pr
        arm = (ArmSpec(self.name, self.plugin_target, "plugin arm", source="--model") if self.arm == "plugin"
               else load_arms()[self.arm])
        kind = "plugin arm" if self.arm == "plugin" else "built-in arm"
        return load_impl(arm), Provenance(self.name, f"{kind} {arm.talker}")

    def make_model(self, impl: Any) -> Any:
        from harness.families.qwen2_5_omni.model import bind_arm
        from harness.sim.rows import RowSpace

        model = bind_arm(impl, RowSpace(SEED))
        model.profile_run(32)
        return model

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        from harness.config import PromptSet, load_prompts
        from harness.sim.rows import RowSpace
        from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table

        ps = load_prompts("default")
        ps = PromptSet(ps.name, ps.description, ps.system_prompt, ps.prompts[:count], ps.path)
        outputs = run_thinker(ps, RowSpace(SEED), 1.0)
        table = token_id_table(outputs)
        return [ConformRequest(o.request_id, list(o.talker_prompt_ids), o.payload(table),
                               fixed_tokens(o.request_id, generated + 1, self.codec_vocab)) for o in outputs]

    def request_tables(self, req: ConformRequest) -> dict[str, torch.Tensor]:
        from harness.families.qwen2_5_omni.model import VOICE, SimTalkerModelBase
        from harness.sim.rows import RowSpace

        m = SimTalkerModelBase(RowSpace(SEED))  # the same special rows as every model instance
        out0 = req.payload["hidden_states"]["output"][0:1]
        return {"Thinker prompt row": req.payload["embed"]["prefill"],
                "Thinker output row": req.payload["hidden_states"]["output"],
                "the speaker + codec-PAD row (P-2)": m.embed_text_spk_tokens[VOICE] + m.embed_codec_pad_token,
                "Thinker output row 0 + codec-BOS (P-1)": out0 + m.embed_codec_bos_token}

    def named_rows(self, model: Any) -> dict[str, torch.Tensor]:
        return {"the text-EOS row": model.embed_text_eos_token, "the text-PAD row": model.embed_text_pad_token}
