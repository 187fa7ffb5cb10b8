"""The phase contract checked inside the real Talker worker: misaligned positions per call.

Why in the worker: the rows a Talker position is conditioned on exist only there. For each
``talker_preprocess`` call the trace plugin hands this module the call's metadata, the ids it
was given and what the runner will copy into the span (vLLM-Omni 0.30.0's
``gpu_model_runner.py``: ``req_embeds[:min(n, rows)]`` into positions ``c..c+seg-1``; positions
past ``seg`` keep the runner's ``inputs_embeds`` slice, as the call left it). The expected rows
are built from the same payload with the *release's* helpers (DESIGN.md "expected conditioning"):
the class members of the installed model class captured by :func:`capture_release` before any arm
is bound (``harness.serve.arm_binding.bind`` binds every member an arm class defines, so an arm that
overrides ``_thinker_to_talker_prefill``, ``_get_embed_text_spk_token`` or any other helper would
otherwise move the delivered rows and the expected rows together). The model is read through
:class:`ReleaseView`: class members from that capture, instance state (the special-token embeddings
the release's loader computed, ``voice_type``) from the instance, submodules (``talker``) from torch:

* ``p < P``: row ``p`` of ``model._thinker_to_talker_prefill(...)`` (Thinker prompt embeddings,
  speaker + codec PAD, first reply row + codec BOS), the prompt the fixed talker reconstructs;
* ``p >= P``: ``reply[k] + talker.embed_input_ids(id_p)`` with ``k = p - P``,
  ``reply = thinker_result[1:] ++ [text_eos] ++ [text_pad]`` (PAD persisting past the end) and
  ``id_p`` the position's own token as the runner passed it.

The expected rows are computed in float32 from the same tensors. A position is misaligned when its
delivered row differs from the expected one by more than ``ULPS`` units of the delivered dtype's
precision, element by element: ``ULPS * eps(dtype) * (|expected| + mean |expected row|)``. That
absorbs the model's own rounding (vLLM runs the tiny model's Thinker and Talker in bfloat16 on CPU,
where the arm may sum in float32 and round once, or round each term), while a row from another
position, request or region differs by the size of the row itself. Counts are split into the text and end regions
(``harness.contract.misaligned_regions``). Exact and audio-free: it means something on a random
model too.

Row identities (issue 32): compared by value alone, a row from the wrong offset that happens to hold
the same values counts as aligned, and in the speaking checkpoint a Thinker row depends only on its
byte. With ``OMNI_STRESS_ROW_IDS=1`` (the launcher sets it for the speaking checkpoint) the trace
plugin hands the arm copies of the Thinker rows (``embed.prefill``, ``hidden_states.output``) that
carry a code in :data:`ROW_ID_DIMS`, dimensions every row of that checkpoint leaves at exactly zero
(``harness.families.qwen2_5_omni.speaking_model.ROW_ID``): which kind of row (prompt or output), which request,
which index (:func:`tag_payload`). The codes ride along whatever the arm does with the rows (slices,
concatenation, sums with special-token and codec embeddings, queues kept in the payload), so the
delivered row says where it came from; the expected row is built from the same tagged payload; a
position is then misaligned when its other dimensions differ beyond the tolerance *or* its code is
not the expected one (exactly: the codes are small integers, exact in bfloat16). Before the runner
copies anything the codes are zeroed again (:func:`strip_ids`), so the Talker's forward receives
exactly the rows it would have without them. Rows nobody tags (the special-token embeddings, codec
embeddings, 0.30.0's zero fallback pool) carry code 0 and are still compared by value; they are
unique by value in that checkpoint except codec embeddings, which are zero there except codec-BOS.
The payload is left untagged (value comparison, as on a random model) when any of its Thinker rows
is non-zero in those dimensions. An arm that mixes dimensions (normalises a row, projects it) would
spread the code; the shipped arms and upstream slice, concatenate and add.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from harness.contract import misaligned_regions

ULPS = 4
ROW_ID_DIMS = (60, 61, 62, 63)  # kind, request code, index // 256, index % 256 (speaking_model.ROW_ID)
_IDS = slice(ROW_ID_DIMS[0], ROW_ID_DIMS[-1] + 1)  # the same dimensions as a slice: no index tensor to copy
assert tuple(range(_IDS.start, _IDS.stop)) == ROW_ID_DIMS
KIND_PROMPT, KIND_OUTPUT = 1, 2
ENV_ROW_IDS = "OMNI_STRESS_ROW_IDS"


def request_code(request_id: Any) -> int:
    """1..255 from the request id (crc32): rows of another request carry another code, mostly."""
    import zlib

    return 1 + zlib.crc32(str(request_id).encode("utf-8")) % 255


def _tagged(rows: Any, kind: int, code: int) -> Any:
    import torch

    out = rows.clone()
    idx = torch.arange(rows.shape[0], device=rows.device)
    dims = list(ROW_ID_DIMS)
    out[:, dims[0]] = kind
    out[:, dims[1]] = code
    out[:, dims[2]] = (idx // 256).to(out.dtype)
    out[:, dims[3]] = (idx % 256).to(out.dtype)
    return out


def tag_payload(info: dict[str, Any]) -> dict[str, Any] | None:
    """``info`` with tagged copies of its Thinker prompt and output rows (the runner's own dicts are not
    touched), or None when the rows cannot carry codes (missing, too narrow, or non-zero in
    :data:`ROW_ID_DIMS`: not the speaking checkpoint)."""
    import torch

    embed, hs = info.get("embed"), info.get("hidden_states")
    if not isinstance(embed, dict) or not isinstance(hs, dict):
        return None
    prefill, output = embed.get("prefill"), hs.get("output")
    dims = list(ROW_ID_DIMS)
    for rows in (prefill, output):
        if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or rows.shape[1] <= max(dims) or rows.shape[0] > 65535:
            return None
        if bool(rows[:, dims].any()):
            return None
    code = request_code(info.get("request_id"))
    return {**info, "embed": {**embed, "prefill": _tagged(prefill, KIND_PROMPT, code)},
            "hidden_states": {**hs, "output": _tagged(output, KIND_OUTPUT, code)}}


def strip_ids(result: Any, input_embeds: Any) -> Any:
    """What the runner must copy: the arm's result with the codes zeroed in a copy of its rows, and the
    runner's own slice (which an arm may have written in place) zeroed there too. Every row of the
    checkpoint is zero in those dimensions, so this restores exactly the rows an untagged call gives."""
    import torch

    dims = list(ROW_ID_DIMS)
    if isinstance(input_embeds, torch.Tensor) and input_embeds.ndim == 2 and input_embeds.shape[1] > max(dims):
        input_embeds[:, dims] = 0
    if not (isinstance(result, tuple) and len(result) >= 2 and isinstance(result[1], torch.Tensor)
            and result[1].ndim == 2 and result[1].shape[1] > max(dims)):
        return result
    rows = result[1].clone()
    rows[:, dims] = 0
    return (result[0], rows, *result[2:])


def tag_payload_on_device(info: dict[str, Any]) -> tuple[dict[str, Any], Any] | None:
    """:func:`tag_payload` without reading a value back: the shapes are checked on the host; whether the
    Thinker rows are zero in :data:`ROW_ID_DIMS` stays a 0-dim bool tensor ``coded`` on their device,
    and each row is its tagged copy where ``coded`` holds, itself elsewhere (``torch.where``). Returns
    ``(payload, coded)``, or None when the shapes cannot carry codes. :func:`tag_payload`'s ``.any()``
    is a device sync per call; this is the trace plugin's path (issue 34)."""
    import torch

    embed, hs = info.get("embed"), info.get("hidden_states")
    if not isinstance(embed, dict) or not isinstance(hs, dict):
        return None
    prefill, output = embed.get("prefill"), hs.get("output")
    for rows in (prefill, output):
        if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or rows.shape[1] <= max(ROW_ID_DIMS) \
                or rows.shape[0] > 65535:
            return None
    if prefill.device != output.device:
        return None
    request_id = info.get("request_id")
    key = (request_id, id(prefill), id(output))
    hit = _TAGS.get(key)
    if hit is not None and hit.fresh(prefill, output):
        _TAGS.move_to_end(key)
        tagged_prefill, tagged_output, coded = hit.tagged_prefill, hit.tagged_output, hit.coded
    else:
        coded = ~(prefill[:, _IDS].any() | output[:, _IDS].any())
        code = request_code(request_id)
        tagged_prefill = torch.where(coded, _tagged(prefill, KIND_PROMPT, code), prefill)
        tagged_output = torch.where(coded, _tagged(output, KIND_OUTPUT, code), output)
        _TAGS[key] = _Tagged(prefill, output, tagged_prefill, tagged_output, coded)
        _TAGS.move_to_end(key)
        while len(_TAGS) > TAG_CACHE_SIZE:
            _TAGS.popitem(last=False)
    return ({**info, "embed": {**embed, "prefill": tagged_prefill},
             "hidden_states": {**hs, "output": tagged_output}}, coded)


TAG_CACHE_SIZE = 16  # requests whose tagged rows are kept (a Talker batch is max_num_seqs of them)


@dataclass
class _Tagged:
    """One request's tagged Thinker rows, reused while neither the runner's rows nor the copies the arm
    was handed have changed: the same tensors with the same in-place version counters, so an arm that
    writes into the rows it was given gets fresh copies at its next call. Inference tensors (the real
    worker runs under ``torch.inference_mode``) keep no version counter: there the same tensors with the
    same storage and shape count as unchanged, and an arm's in-place write stays in its copy for its
    next call, as it would stay in the runner's own rows untagged. Why: a request's payload is the same
    tensors at every step (vLLM-Omni 0.30.0's ``model_intermediate_buffer``), and tagging them again per
    call was a fifth of a traced call's time in a profile (issue 34)."""

    prefill: Any
    output: Any
    tagged_prefill: Any
    tagged_output: Any
    coded: Any
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.versions = self._now()

    def _now(self) -> tuple[int, ...]:
        tensors = (self.prefill, self.output, self.tagged_prefill, self.tagged_output)
        if any(t.is_inference() for t in tensors):  # no version counter: storage and shape only
            return tuple(x for t in tensors for x in (t.data_ptr(), *t.shape))
        return tuple(t._version for t in tensors)

    def fresh(self, prefill: Any, output: Any) -> bool:
        return prefill is self.prefill and output is self.output and self._now() == self.versions


_TAGS: collections.OrderedDict[tuple, _Tagged] = collections.OrderedDict()


def strip_ids_on_device(result: Any, input_embeds: Any, coded: Any) -> Any:
    """:func:`strip_ids` where ``coded`` (the 0-dim tensor of :func:`tag_payload_on_device`) holds, the
    rows untouched where it does not (a checkpoint whose rows use those dimensions), without a sync."""
    import torch

    if isinstance(input_embeds, torch.Tensor) and input_embeds.ndim == 2 and input_embeds.shape[1] > max(ROW_ID_DIMS):
        input_embeds[:, _IDS].masked_fill_(coded.to(input_embeds.device), 0)
    if not (isinstance(result, tuple) and len(result) >= 2 and isinstance(result[1], torch.Tensor)
            and result[1].ndim == 2 and result[1].shape[1] > max(ROW_ID_DIMS)):
        return result
    rows = result[1].clone()
    rows[:, _IDS].masked_fill_(coded.to(rows.device), 0)
    return (result[0], rows, *result[2:])

_RELEASES: dict[type, dict[str, Any]] = {}  # model class -> its members as the release defined them


def capture_release(model_cls: type) -> dict[str, Any]:
    """The members of ``model_cls`` and its bases (nearest first) as they are now, kept for the
    contract; call before any arm is bound. The first capture of a class wins: a later call on a
    class already captured, or on a subclass of one (the class an arm binding builds), returns that
    capture, never the bound members."""
    for klass in model_cls.__mro__:
        if klass in _RELEASES:
            return _RELEASES[klass]
    members: dict[str, Any] = {}
    for klass in model_cls.__mro__:
        for name, value in vars(klass).items():
            members.setdefault(name, value)
    members["__release_class__"] = model_cls
    _RELEASES[model_cls] = members
    return members


class ReleaseView:
    """``model`` as the release sees it: attribute lookup follows Python's order (data descriptors,
    then the instance's own attributes, then other class members) over the *captured* release
    members, then torch's submodules/parameters/buffers; an arm's bound members are never seen.
    Methods found here are bound to the view, so the helpers they call are the release's too."""

    __slots__ = ("_model", "_members")

    def __init__(self, model: Any, members: dict[str, Any]) -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_members", members)

    def __getattr__(self, name: str) -> Any:
        model, members = self._model, self._members
        value = members.get(name, _MISSING)
        own = getattr(model, "__dict__", {})
        if value is not _MISSING and hasattr(type(value), "__set__"):  # property: beats the instance
            return value.__get__(self, members["__release_class__"])
        if name in own:
            return own[name]
        if value is not _MISSING:
            if hasattr(value, "__get__"):  # functions, static and class methods
                return value.__get__(self, members["__release_class__"])
            return value
        import torch

        if isinstance(model, torch.nn.Module):
            return torch.nn.Module.__getattr__(model, name)
        raise AttributeError(f"the release's {type(model).__name__} has no attribute {name!r}")


_MISSING = object()


def release_view(model: Any) -> ReleaseView:
    """``model`` through its release's captured members (captured now if nothing bound an arm first)."""
    return ReleaseView(model, capture_release(type(model)))


def _payload(info: dict[str, Any]) -> tuple[Any, Any, list[int], list[int]]:
    embed = info.get("embed") or {}
    hs = info.get("hidden_states") or {}
    ids = info.get("ids") or {}
    return embed.get("prefill"), hs.get("output"), list(ids.get("prompt") or []), list(ids.get("output") or [])


def expected_rows(model: Any, info: dict[str, Any], ids: Any, P: int, c: int, n: int, dtype: Any) -> Any:
    """The contract's rows for positions ``c..c+n-1`` ([n, H], in ``dtype``); raises when the payload can't
    give them."""
    import torch

    model = release_view(model)
    prefill, thinker_result, prompt_ids, output_ids = _payload(info)
    if not isinstance(thinker_result, torch.Tensor) or thinker_result.ndim != 2 or thinker_result.shape[0] == 0:
        raise ValueError("no Thinker output rows (hidden_states.output)")
    device = ids.device
    rows = []
    n_prompt = max(0, min(P - c, n))
    if n_prompt:
        thinker_result = thinker_result.to(device=device, dtype=dtype)
        if not isinstance(prefill, torch.Tensor):
            raise ValueError("no Thinker prompt embeddings (embed.prefill)")
        _, prompt = model._thinker_to_talker_prefill(
            speaker=getattr(model, "voice_type", "Chelsie"), output_prompt_embeds=thinker_result,
            output_token_ids=output_ids, thinker_prompt_embeds=prefill.to(device=device, dtype=dtype),
            prompt_token_ids=prompt_ids,
        )
        if prompt.shape[0] != P:
            raise ValueError(f"reconstructed prompt has {prompt.shape[0]} rows, runner prompt length {P}")
        rows.append(prompt[c : c + n_prompt].to(dtype))
    if n_prompt < n:
        codec = model.talker.embed_input_ids(ids[n_prompt:n].to(device)).to(dtype)
        rows.append(reply_rows(model, thinker_result, c + n_prompt - P, n - n_prompt, device, dtype) + codec)
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def reply_rows(model: Any, thinker_result: Any, first_k: int, m: int, device: Any, dtype: Any) -> Any:
    """Rows ``first_k..first_k+m-1`` of ``reply = thinker_result[1:] ++ [text_eos] ++ [text_pad]``, the
    PAD row repeated past the end: the same values as indexing the whole reply, from slices of its
    parts. Why: a decode call needs one row, and the whole reply was concatenated and converted for it at
    every call (issue 34)."""
    import torch

    body = thinker_result.shape[0] - 1  # reply rows taken from the Thinker's output
    stop = first_k + m
    parts = []
    if first_k < body:
        parts.append(thinker_result[1 + first_k : 1 + min(stop, body)].to(device=device, dtype=dtype))
    if first_k <= body < stop:
        parts.append(model.embed_text_eos_token.to(device=device, dtype=dtype))
    pads = stop - max(first_k, body + 1)
    if pads > 0:
        pad = model.embed_text_pad_token.to(device=device, dtype=dtype)
        parts.append(pad if pads == 1 else pad.expand(pads, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def delivered_rows(result: Any, embeds_after: Any, n: int) -> tuple[Any, int]:
    """What the runner copies into the span: ``req_embeds[:seg]`` then the slice's own rows; and
    how many trailing positions have no defined row (the runner allocates ``torch.empty`` when it
    passed no embeddings)."""
    import torch

    req_embeds = result[1]
    seg = min(n, int(req_embeds.shape[0]))
    parts = [req_embeds[:seg]]
    undefined = 0
    if seg < n:
        if isinstance(embeds_after, torch.Tensor) and embeds_after.shape[0] >= n:
            parts.append(embeds_after[seg:n].to(req_embeds.dtype))
        else:
            undefined = n - seg
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)), undefined


@dataclass
class PendingContract:
    """One call's contract result with its values still on the device (issue 34: a GPU worker must
    not sync per call): ``mask`` is the bool tensor of positions ``c..c+defined-1`` whose delivered row
    is not the contract's; the rest are host facts. :meth:`finish` turns the mask's values, read back
    whenever the trace writer has them, into the trace keys."""

    mask: Any
    c: int
    defined: int
    undefined: int
    P: int
    last_reply: int  # index of the last Thinker output row (its reply ends there)

    def finish(self, mask_values: list[int]) -> dict[str, Any]:
        bad = [self.c + i for i, v in enumerate(mask_values) if v] + [self.c + self.defined + i
                                                                      for i in range(self.undefined)]
        text, end = misaligned_regions(bad, self.P, self.last_reply)
        # text_len: the request's text region past the prompt (``misaligned_regions``' ``reply_len``), which the
        # backend needs to count replays ending inside the text (``harness.contract.ends_in_text``)
        out: dict[str, Any] = {"misaligned_text": text, "misaligned_end": end, "text_len": self.last_reply}
        if bad:
            out["first_misaligned"] = bad[0]
        return out


def _without_ids(rows: Any) -> Any:
    """``rows`` without the :data:`ROW_ID_DIMS` columns: a view when they are the last ones (the speaking
    checkpoint's 64 dimensions), else a copy."""
    import torch

    if _IDS.stop >= rows.shape[1]:
        return rows[:, :_IDS.start]
    return torch.cat([rows[:, :_IDS.start], rows[:, _IDS.stop:]], dim=1)


def misaligned_on_device(model: Any, info: dict[str, Any], ids_before: Any, result: Any, embeds_after: Any,
                         row_ids: bool = False, coded: Any = None) -> PendingContract | dict[str, Any]:
    """The comparison of :func:`count_misaligned`, left on the device: a :class:`PendingContract`, or
    ``{"contract_error": why}``. ``coded``: the 0-dim tensor of :func:`tag_payload_on_device`; the
    identities are compared only where it holds (``row_ids`` is then implied)."""
    import torch

    try:
        P = int(info["_omni_prompt_len"])
        c = int(info["_omni_num_computed_tokens"])
        n = int(ids_before.shape[0])
        got, undefined = delivered_rows(result, embeds_after, n)
        want = expected_rows(model, info, ids_before, P, c, n, torch.float32)
        defined = got.shape[0]
        want = want[:defined]
        eps = torch.finfo(got.dtype).eps if got.dtype.is_floating_point else 0.0
        got = got.float()
        same_id = None
        if row_ids or coded is not None:
            same_id = (got[:, _IDS] == want[:, _IDS]).all(dim=1)
            if coded is not None:
                same_id = same_id | ~coded.to(same_id.device)
            got, want = _without_ids(got), _without_ids(want)
        size = want.abs()
        tol = ULPS * eps * (size + size.mean(dim=1, keepdim=True))
        close = ((got - want).abs() <= tol).all(dim=1)
        if same_id is not None:
            close &= same_id
        _, thinker_result, _, _ = _payload(info)
        return PendingContract(~close, c, int(defined), undefined, P, int(thinker_result.shape[0]) - 1)
    except Exception as exc:  # noqa: BLE001 - the check must never break the server
        return {"contract_error": f"{type(exc).__name__}: {exc}"}


def count_misaligned(model: Any, info: dict[str, Any], ids_before: Any, result: Any, embeds_after: Any,
                     row_ids: bool = False) -> dict[str, Any]:
    """``{"misaligned_text": t, "misaligned_end": e}`` (plus ``first_misaligned``, the first such position,
    when there is one) for one call, or ``{"contract_error": why}``. ``row_ids``: ``info`` is the tagged
    payload the arm saw (:func:`tag_payload`) and ``result`` still carries the codes: they must match
    exactly, the other dimensions within the tolerance. Reads the mask back at once (one transfer); the
    trace plugin defers that (:func:`misaligned_on_device`)."""
    pending = misaligned_on_device(model, info, ids_before, result, embeds_after, row_ids)
    if isinstance(pending, dict):
        return pending
    try:
        return pending.finish(pending.mask.tolist())
    except Exception as exc:  # noqa: BLE001 - the check must never break the server
        return {"contract_error": f"{type(exc).__name__}: {exc}"}
