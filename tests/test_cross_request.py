"""Issue 45, item 3 (its count): a position that runs with another request's row, or whose code predictor reads
another request's hidden state, is a cross-request position (the record count ``cross_request_positions``),
reported beside the misaligned positions and bounded by every family's gate: what state an arm keeps across
calls and does not key by request does (upstream: one request's onset in another's voice, a payload cloned
into every request of a batch).

The sim's rows say whose they are: a registered text row names its request (``harness.sim.rows.TextMeaning``),
the Talker's hidden state per request and position is distinct (``harness.sim.runner.hidden_rows``); rows
every request shares (the role, the specials) are nobody's.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

FIX = "harness.families.qwen3_tts.fix:Qwen3TTSFixedTalker"


def _cell(arm_target: str, deploy: str = "qwen3-tts-stress", voices: bool = True,
          prompt_set: str = "qwen3_tts") -> tuple[Any, Any]:
    """The family's sim cell on ``prompt_set`` (``voices=False``: every prompt in the default voice) and a runner
    over it."""
    import dataclasses

    from harness.config import ArmSpec, load_deploy, load_prompts
    from harness.family import get_family
    from harness.talkers import load_impl

    arm = ArmSpec(name="x", talker=arm_target, role="candidate", family="qwen3-tts", source="--arm")
    d = load_deploy(deploy)
    prompts = load_prompts(prompt_set)
    if not voices:
        prompts = dataclasses.replace(prompts, prompts=tuple(dataclasses.replace(p, speaker=None)
                                                             for p in prompts.prompts))
    cell = get_family("qwen3-tts").sim_cell(load_impl(arm), d, prompts, 42, "words")
    return cell, cell.runner_class(cell.model, cell.space, ("x", deploy, 1), cell.contract, d.talker.model_runner)


def _two_requests(arm_target: str, deploy: str = "qwen3-tts-stress", voices: bool = True,
                  prompt_set: str = "qwen3_tts") -> tuple[dict[str, int], list[int]]:
    """Two requests admitted in one step, then three steps decoding both: each request's cross-request
    positions, and the misaligned positions of each call in order."""
    cell, runner = _cell(arm_target, deploy, voices, prompt_set)
    outs = cell.requests[:2]
    for out in outs:
        runner.add_request(out, out.payload({}), 4096)
    misaligned = []
    for step in range(4):
        spans = [(out, 0, out.P) if step == 0 else (out, out.P + step - 1, 1) for out in outs]
        runner.begin_step([(out.request_id, c, n) for out, c, n in spans])
        for out, c, n in spans:
            gen = [500 + k for k in range(max(0, c + n - out.P))]
            req = SimpleNamespace(request_id=out.request_id, prompt_token_ids=out.talker_prompt_ids,
                                  all_token_ids=out.talker_prompt_ids + gen,
                                  sampling_params=SimpleNamespace(max_tokens=640, seed=42))
            misaligned.append(runner.call(req, c, n, step).span.misaligned)
    return {out.request_id: runner.cross.get(out.request_id, 0) for out in outs}, misaligned


def test_the_fix_runs_every_position_with_its_own_request_rows():
    cross, misaligned = _two_requests(FIX)
    assert list(cross.values()) == [0, 0] and misaligned == [0] * 8


def test_a_payload_cloned_into_every_request_of_a_batch_is_cross_request():
    """``BatchPromptOfFirst`` stores the first request's prompt and text in the second's buffer: the second's
    prompt's speaker row (the first's voice: the set mixes voices, Vivian then Ryan) and text row (the text's
    first token), and every decode's text row, are the first request's."""
    cross, misaligned = _two_requests("tests.fixtures.tts_mutants:BatchPromptOfFirst")
    assert list(cross.values()) == [0, 5]
    assert misaligned == [0, 2, 0, 1, 0, 1, 0, 1]


def test_a_voice_kept_across_requests_is_cross_request():
    """Issue 45, item 3: ``VoiceOfFirstRequest`` builds every prompt with the first request's voice. The second
    request (Ryan) gets Vivian's speaker row, one position of its prompt: cross-request and misaligned; its text
    rows are its own. With one voice for both (the set's voices removed) nothing shows: why the stress sets mix
    voices."""
    target = "tests.fixtures.tts_mutants:VoiceOfFirstRequest"
    cross, misaligned = _two_requests(target)
    assert list(cross.values()) == [0, 1] and misaligned == [0, 1, 0, 0, 0, 0, 0, 0]
    cross, misaligned = _two_requests(target, voices=False)
    assert list(cross.values()) == [0, 0] and misaligned == [0] * 8


def test_a_voice_nobody_in_the_cell_has_is_misaligned_only():
    """A speaker codec no request of the cell has (Sohee: the set's voices are Vivian, Ryan, Serena, Aiden) is
    wrong but nobody's; another request's voice is cross-request; the request's own is neither."""
    import numpy as np

    from harness.families.qwen3_tts.sim import SPEAKER_CODECS

    cell, runner = _cell(FIX)
    first, second = cell.requests[:2]
    codecs = np.array([SPEAKER_CODECS["sohee"], SPEAKER_CODECS["vivian"], SPEAKER_CODECS["ryan"], 100])
    assert cell.contract.foreign_voice(second, codecs).tolist() == [False, True, False, False]
    assert cell.contract.foreign_voice(first, codecs).tolist() == [False, False, True, False]


def test_a_past_hidden_state_not_keyed_by_request_is_cross_request_and_zeros_are_not():
    # the previous call's past hidden state: the first decode is right (nothing kept yet), every later one
    # reads the other request's
    cross, misaligned = _two_requests("tests.fixtures.tts_mutants:PastHiddenOfLastCall")
    assert list(cross.values()) == [2, 3] and misaligned == [0, 0, 0, 1, 1, 1, 1, 1]
    # zeros are wrong (misaligned) but nobody's
    cross, misaligned = _two_requests("tests.fixtures.tts_mutants:ZeroPastHidden")
    assert list(cross.values()) == [0, 0] and misaligned == [0, 0, 1, 1, 1, 1, 1, 1]


def test_a_row_of_a_request_not_admitted_yet_is_still_anothers():
    """The Thinker registers every request's rows when the cell starts, before the scheduler admits them: a row
    of a request the runner has not seen yet is still that request's, not a shared one."""
    import numpy as np

    cell, runner = _cell(FIX)
    first, later = cell.requests[:2]
    runner.add_request(first, first.payload({}), 4096)
    rows = np.array([first.text_first_id, later.text_first_id, later.text_first_id + 1], dtype=np.int64)
    codecs = np.zeros(3, dtype=np.int64)
    assert runner._foreign(first.request_id, first, rows, codecs) == 2
    runner.add_request(later, later.payload({}), 4096)
    assert runner._foreign(later.request_id, later, rows, codecs) == 1
