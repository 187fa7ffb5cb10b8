"""Which of a Talker model's hooks vLLM-Omni's model runners call, in which order, with which fallbacks.

Read from vLLM-Omni 0.30.0's runners (0.32.0rc1's are the same here, except ``preprocess_batch_fills_rows``,
below); the sim's runners (``harness.sim.runner``, the families' runner classes) and ``conform``'s driver
call a model's hooks through this module only, so the three cannot drift apart:

* **V1** (``worker/gpu_model_runner.py``): once per step, before any request's call,
  ``preprocess_batch(req_ids=<the step's requests>, model_intermediate_buffer=<every buffer>, device=...)``
  if the model defines it (``_maybe_run_batch_preprocess``, l.1595). Then per request: a one-token span
  past the prompt goes to ``preprocess_decode_batch(input_ids=, req_infos=)`` if the model defines it
  (l.1762-1845; no ``input_embeds``: the hook embeds the ids itself), every other span to ``preprocess``.
* **MRV2** (``worker_v2/model_states/omni_model_state.py``): once per step
  ``preprocess_batch_mrv2(req_infos=<the prefill requests' buffers>, device=...)`` if defined (l.593-603).
  A one-token span past the prompt goes to ``preprocess_decode_batch_mrv2``, else to
  ``preprocess_decode_batch`` (``_resolve_decode_preprocess``, l.171-190), given the runner's
  ``input_embeds`` when the hook takes them (a parameter of that name, or ``**kwargs``); every other span
  to ``preprocess``.

Both decode hooks return ``(ids, rows, past_hidden, text_step, updates)`` on a model with the MTP path,
V1's ``(ids, rows, updates)`` without it. 0.32.0rc1's V1 runner adds one path: a model that sets
``preprocess_batch_fills_rows`` writes whole requests' rows in ``preprocess_batch`` and the per-request
loop skips them. No release Talker of the three families sets it and the sim does not model it, so an arm
that sets it is refused (:func:`refuse_unmodelled`) instead of being run down a path it would not take.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

DECODE_HOOKS: dict[str, tuple[str, ...]] = {
    "v1": ("preprocess_decode_batch",),
    "v2": ("preprocess_decode_batch_mrv2", "preprocess_decode_batch"),
}
PREFILL_BATCH_HOOK: dict[str, str] = {"v1": "preprocess_batch", "v2": "preprocess_batch_mrv2"}
# every hook a runner may call besides the per-span one: a release class's methods of these names are
# compiled onto the sim's stand-in with it (harness.talkers.upstream.build_mixin), so that the hook the
# runner under test calls is the release's own
RUNNER_HOOKS: tuple[str, ...] = ("preprocess_decode_batch", "preprocess_decode_batch_mrv2", "preprocess_batch",
                                 "preprocess_batch_mrv2")
UNMODELLED = "preprocess_batch_fills_rows"


def kind(runner: str) -> str:
    """``v2`` (MRV2) or ``v1`` (every other runner value)."""
    return "v2" if runner == "v2" else "v1"


def decode_hook_name(model: Any, runner: str) -> str | None:
    """The hook the runner calls for a one-token decode span of ``model``; None: ``preprocess``."""
    for name in DECODE_HOOKS[kind(runner)]:
        if callable(getattr(model, name, None)):
            return name
    return None


def decode_hook(model: Any, runner: str) -> Callable[..., tuple[Any, ...]] | None:
    """``f(input_ids=, input_embeds=, req_infos=)`` calling the decode hook as ``runner`` calls it; None
    where the runner calls ``preprocess`` for decode spans too."""
    name = decode_hook_name(model, runner)
    if name is None:
        return None
    hook = getattr(model, name)
    if kind(runner) == "v1":
        return lambda *, input_ids, input_embeds, req_infos: hook(input_ids=input_ids, req_infos=req_infos)
    params = inspect.signature(hook).parameters
    if "input_embeds" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda *, input_ids, input_embeds, req_infos: hook(input_ids=input_ids, input_embeds=input_embeds,
                                                                 req_infos=req_infos)
    return lambda *, input_ids, input_embeds, req_infos: hook(input_ids=input_ids, req_infos=req_infos)


def unpack_decode(result: Any) -> tuple[Any, Any, Any, Any, list[dict[str, Any]]]:
    """``(ids, rows, past_hidden, text_step, updates)`` from either return shape (V1's three values
    without the MTP path: ``past_hidden`` and ``text_step`` None)."""
    if len(result) == 5:
        return tuple(result)  # type: ignore[return-value]
    ids, rows, updates = result
    return ids, rows, None, None, updates


def prefill_batch(model: Any, runner: str, req_ids: list[str], buffers: dict[str, dict[str, Any]],
                  prefill_ids: list[str], device: Any) -> str | None:
    """The step's batch hook before its per-request calls, as ``runner`` calls it; its name, or None if the
    model defines none. V1 hands every scheduled request's id and the whole buffer map, MRV2 the prefill
    requests' buffers only (and nothing when no request of the step is in its prompt)."""
    name = PREFILL_BATCH_HOOK[kind(runner)]
    hook = getattr(model, name, None)
    if not callable(hook):
        return None
    if kind(runner) == "v1":
        hook(req_ids=list(req_ids), model_intermediate_buffer=buffers, device=device)
    elif prefill_ids:
        hook(req_infos=[buffers[r] for r in prefill_ids if r in buffers], device=device)
    return name


def refuse_unmodelled(model: Any) -> str | None:
    """Why the runner cannot run ``model`` as a release would, or None."""
    if getattr(model, UNMODELLED, False):
        return (f"it sets {UNMODELLED} (vLLM-Omni 0.32.0rc1's V1 runner then lets preprocess_batch write whole "
                "requests' rows and skips their preprocess calls): a path the sim does not model")
    return None
