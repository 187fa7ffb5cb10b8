"""Issue 32, item 3: the worker's contract check builds its expected rows from the release's helpers,
captured before any arm is bound, so an arm that overrides a helper (``_thinker_to_talker_prefill``,
``_get_embed_text_spk_token``) cannot move the yardstick with its rows. Run on the sim's model host
(the same helper methods as vLLM-Omni's model), bound the way the real server binds an arm."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from harness.config import load_prompts
from harness.serve import arm_binding
from harness.serve.worker_contract import capture_release, count_misaligned, release_view
from harness.families.qwen2_5_omni.model import SimTalkerModelBase
from harness.sim.rows import RowSpace
from harness.families.qwen2_5_omni.thinker import run_thinker, token_id_table
from harness.families.qwen2_5_omni.helpers import Qwen25OmniTalkerHelpers


def _release_model(monkeypatch: pytest.MonkeyPatch, name: str) -> types.ModuleType:
    """A fresh 'installed model' class (the release's helpers and state), in its own module as vLLM's is."""
    module = types.ModuleType(f"fake_release_{name}")
    module.__file__ = __file__

    def talker_preprocess(self, input_ids, input_embeds, **info):  # noqa: ANN001, ANN202
        raise AssertionError("the release's own preprocess is not the arm")

    model_cls = type("Qwen2_5OmniForConditionalGeneration", (Qwen25OmniTalkerHelpers, SimTalkerModelBase),
                     {"talker_preprocess": talker_preprocess, "__module__": module.__name__})
    module.Qwen2_5OmniForConditionalGeneration = model_cls
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _bound_call(monkeypatch: pytest.MonkeyPatch, spec: str, c: int, n: int) -> tuple[dict, int, object]:
    module = _release_model(monkeypatch, spec.rpartition(":")[2])
    release_cls = module.Qwen2_5OmniForConditionalGeneration
    arm_binding.bind(release_cls, spec)
    built = module.Qwen2_5OmniForConditionalGeneration  # what vLLM's registry resolves by name
    space = RowSpace(0)
    model = built.__new__(built)
    SimTalkerModelBase.__init__(model, space)
    out = run_thinker(load_prompts("default"), space, 1.0)[0]
    ids = torch.tensor(list(out.talker_prompt_ids)[c:c + n], dtype=torch.int64)
    embeds = model.talker.embed_input_ids(ids)
    info = {**out.payload(token_id_table([out])), "_omni_prompt_len": out.P, "_omni_num_computed_tokens": c,
            "_omni_is_prefill": True, "request_id": out.request_id}
    result = model.talker_preprocess(input_ids=ids, input_embeds=embeds, **info)
    return count_misaligned(model, info, ids.clone(), result, embeds), out.P, model


def test_pr_bound_the_same_way_is_aligned(monkeypatch: pytest.MonkeyPatch) -> None:
    got, P, _ = _bound_call(monkeypatch, "harness.families.qwen2_5_omni.pr:FixedTalker", 0, 61)
    # text_len: the reply's rows up to text-EOS past the prompt, what the backend counts replays ending in text by
    assert P == 61 and got == {"misaligned_text": 0, "misaligned_end": 0, "text_len": 58}


def test_an_arm_overriding_the_speaker_helper_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = "tests.fixtures.helper_override_arm:SpeakerSwapPr"
    _, P, _ = _bound_call(monkeypatch, spec, 0, 8)
    got, P, model = _bound_call(monkeypatch, spec, P - 8, 8)  # the last chunk holds the speaker row, P - 2
    assert got == {"misaligned_text": 1, "misaligned_end": 0, "first_misaligned": P - 2, "text_len": 58}
    # the override is what the model itself now answers: the old check (the model's own helpers) saw 0
    assert torch.equal(model._get_embed_text_spk_token("Chelsie"), model.embed_text_bos_token)
    assert not torch.equal(release_view(model)._get_embed_text_spk_token("Chelsie"), model.embed_text_bos_token)


def test_an_arm_overriding_the_prefill_helper_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    got, P, _ = _bound_call(monkeypatch, "tests.fixtures.helper_override_arm:ShiftedPromptPr", 0, 32)
    assert P > 32 and got == {"misaligned_text": 32, "misaligned_end": 0, "first_misaligned": 0, "text_len": 58}


def test_the_first_capture_wins_and_a_bound_subclass_reads_it() -> None:
    class Release:
        def helper(self) -> str:
            return "release"

    first = capture_release(Release)
    Release.helper = lambda self: "arm"  # what a binding does to the class
    bound = type("Bound", (Release,), {})
    assert capture_release(Release) is first and capture_release(bound) is first
    model = bound()
    assert model.helper() == "arm" and release_view(model).helper() == "release"
    model.state = 7  # instance state is the model's own
    assert release_view(model).state == 7
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        release_view(model).missing  # noqa: B018
