"""The Qwen3-Omni fix: every Talker row by absolute position, no consumed state.

The release's ``talker_preprocess`` finds a decode position's text row by counting: the full-payload path
pops a ``trailing_text`` queue one row per call, the streamed path (``async_chunk: true``) indexes
``cached_decode`` with ``meta.num_processed_tokens``, a counter each call moves by its span length and a
prefill call resets. A replay (preemption by recompute, V1 keeps the buffer) or a chunked prefill that
receives streamed rows breaks the count, and positions get another index's row. This arm assembles what
position ``p`` needs from ``p`` alone (``harness.families.qwen3_omni.contract``):

* ``p < P``: the release's own prompt rows (``_thinker_to_talker_prefill`` over the payload), sliced
  ``[c, c + n)``;
* ``p >= P``, ``k = p - P``: the Thinker's row of reply token ``k + 1``, which sits at index
  ``a + 4 + k`` of the Thinker's rows (``a``: the assistant turn's ``<|im_start|>`` in the prompt ids):
  the payload's ``embed.prefill`` followed, on the streamed path, by every ``embed.decode`` row received so
  far, kept in arrival order under ``embed.fix_stream`` (appended, never consumed); past the last reply
  row ``tts_eos`` (once the Thinker has ``finished``), then ``tts_pad``.

A one-token decode span returns its text row as ``text_step`` in ``mtp_inputs`` (the runner adds it); a
prefill span that runs past ``P`` (a replay) and a longer decode span carry their text rows in the rows
themselves, as the runner adds none there. Speaker, dtypes and the ``codes.audio`` update are the release's.
"""

from __future__ import annotations

from typing import Any

import torch


def _last_row(t: torch.Tensor) -> torch.Tensor:
    """``[..., H]`` -> ``[1, H]``, the last row (``_get_tts_embed``'s ``_ensure_1x1`` for a [1, 1, H] row)."""
    return t.reshape(-1, t.shape[-1])[-1:]


class Qwen3OmniFixedTalker:
    """Mixed in over the release's class (a plugin arm): only ``talker_preprocess`` and its helpers are new."""

    def _fix_voice(self, payload: dict) -> str:
        voice = payload.get("speaker")
        if isinstance(voice, (list, tuple)) and voice:
            voice = voice[0]
        if not isinstance(voice, str) or not voice.strip():
            return self.default_tts_text_spk_type
        return voice.lower().strip()

    def _fix_prompt_rows(self, payload: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``P`` prompt ids and rows, by the release's own assembly (no state read or written)."""
        dev = self._module_device(self.talker)
        embed, hs, ids = payload["embed"], payload["hidden_states"], payload["ids"]
        bf16 = torch.bfloat16
        prompt_ids = torch.as_tensor(ids["prompt"], device=dev).reshape(1, -1)
        all_ids = torch.as_tensor(ids["all"], device=dev)
        req_ids, req_rows, _trailing = self._thinker_to_talker_prefill(
            thinker_embed=embed["prefill"].to(device=dev, dtype=bf16),
            thinker_hidden=hs["output"].to(device=dev, dtype=bf16),
            multimodal_mask=None, input_ids=prompt_ids, thinker_result_ids=all_ids,
            speaker_id=self._get_text_spk_token_id(self._fix_voice(payload)),
            tts_bos_thinker=embed["tts_bos"].to(device=dev, dtype=bf16),
            tts_eos_thinker=embed["tts_eos"].to(device=dev, dtype=bf16),
            tts_pad_thinker=embed["tts_pad"].to(device=dev, dtype=bf16))
        return req_ids, req_rows

    def _fix_thinker_rows(self, payload: dict, update: dict) -> torch.Tensor:
        """Every Thinker row received so far, by index: ``embed.prefill``, then the streamed ``embed.decode``
        rows in arrival order (kept under ``embed.fix_stream``, appended, never consumed)."""
        embed = payload["embed"]
        stream = embed.get("fix_stream")
        incoming = embed.get("decode")
        if incoming is not None:  # a streamed row arrived: keep it
            incoming = incoming.reshape(-1, incoming.shape[-1]).to(torch.bfloat16)
            stream = incoming if stream is None else torch.cat([stream, incoming])
            update.setdefault("embed", {}).update(fix_stream=stream, decode=None)
        rows = embed["prefill"].to(torch.bfloat16)
        return rows if stream is None else torch.cat([rows, stream])

    def _fix_text_rows(self, payload: dict, rows: torch.Tensor, first: int, n: int) -> torch.Tensor:
        """The text rows of decode offsets ``k = first .. first + n - 1`` (``n >= 1``), ``[n, H]``."""
        embed, meta, prompt = payload["embed"], payload.get("meta", {}), list(payload["ids"]["prompt"])
        finished = bool(meta.get("finished", False))
        a = len(prompt) - 1 - prompt[::-1].index(self.config.im_start_token_id)
        proj = self.talker.text_projection
        out = []
        for k in range(first, first + n):
            i = a + 4 + k  # reply token k + 1
            if i < rows.shape[0]:
                out.append(proj(rows[i:i + 1]))
            elif not finished:
                raise RuntimeError(f"decode offset {k}: the Thinker's row {i} has not arrived (the Talker outran "
                                   "its Thinker)")
            elif i == rows.shape[0]:
                out.append(proj(_last_row(embed["tts_eos"]).to(torch.bfloat16)))
            else:
                out.append(proj(_last_row(embed["tts_pad"]).to(torch.bfloat16)))
        return torch.cat(out).to(self._module_device(self.talker))

    def talker_preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor, **info_dict: Any):
        payload = info_dict
        if input_embeds is None and input_ids is not None:
            input_embeds = self.talker.embed_input_ids(input_ids)
        n = int(input_ids.shape[0])
        c = int(payload["_omni_num_computed_tokens"])
        P = int(payload["_omni_prompt_len"])
        update: dict = {}
        thinker_rows = self._fix_thinker_rows(payload, update)
        if c < P:  # prefill (a replay's span may run past P)
            m = min(n, P - c)
            prompt_ids, prompt_rows = self._fix_prompt_rows(payload)
            ids, rows = input_ids.clone(), input_embeds.clone()
            ids[:m] = prompt_ids[c:c + m].to(ids.dtype)
            rows[:m] = prompt_rows[c:c + m].to(rows.dtype)
            if n > m:
                rows[m:] = rows[m:] + self._fix_text_rows(payload, thinker_rows, 0, n - m).to(rows.dtype)
            update.setdefault("codes", {})["audio"] = torch.zeros(
                (n, self.talker.num_code_groups), device=self._module_device(self.talker), dtype=torch.long)
            return ids, rows, update
        text = self._fix_text_rows(payload, thinker_rows, c - P, n)
        if n > 1:  # a multi-position decode span: the runner adds no text step
            return input_ids, input_embeds + text.to(input_embeds.dtype), update
        last = payload.get("hidden_states", {}).get("last")
        if last is not None:
            last = last.to(input_embeds.device, dtype=input_embeds.dtype).reshape(1, -1)
        else:
            last = torch.zeros((1, self.talker_config.text_config.hidden_size), device=input_embeds.device,
                               dtype=input_embeds.dtype)
        update["mtp_inputs"] = last, text.to(input_embeds.dtype)
        return input_ids, input_embeds, update
