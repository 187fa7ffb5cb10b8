"""The fix for Qwen3-TTS's ``preprocess``: every row from the position it is for.

vLLM-Omni 0.30.0 (``qwen3_tts_talker.py`` l.868-1190) keeps two running offsets in the request's
buffer: ``talker_prefill_offset`` (where the next prefill chunk slices the stored prompt) and
``talker_text_offset`` (the next ``trailing_text`` row, consumed one per decode step, the queue
compacted as it goes). Both assume every position is seen once, in order. A preemption breaks that:

* under V1 the buffer survives, so the replay's prefill slices from the old offset (past the
  prompt): every replayed prompt position gets ``tts_pad`` and the generated positions in the
  replay span get ``tts_pad`` with no codec row (``conform``: cross-boundary replay differs @0);
* under MRV2 the buffer is rebuilt, so the prompt is right but the generated positions of the
  replay span still get ``tts_pad`` (@9), and the text queue starts again from its first row at
  the next decode step (restart @20).

This class stores the builder's prompt rows and the *whole* ``trailing_text`` once (never
consumed, never compacted) and gives position ``p`` of any span:

* ``p < P``: prompt row ``p`` (``tts_pad`` where the scheduler's placeholder is longer than the
  prompt, as the release pads);
* ``p >= P``: the codec embedding of ``p``'s own id plus ``trailing_text[p - P]`` (``tts_pad``
  past it); a one-token decode span returns the codec row and hands the text row to the runner's
  MTP path (``mtp_inputs``), as the release does, so the runner adds it once.

Nothing depends on which calls came before, so chunks, replays (V1 or MRV2), restarts and
multi-position decode spans all get the reference's rows. The rows the release publishes for
Code2Wav (``codes.audio``, ``meta.codec_frame_valid``) keep the release's shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.families.qwen3_tts.contract import flatten_payload


class Qwen3TTSFixedTalker:
    """``preprocess`` and ``preprocess_decode_batch`` by absolute position (mixed over the release's class)."""

    # ------------------------------------------------------------------ the stored rows
    def _fix_tables(self, info: dict[str, Any], device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                              dict[str, Any]]:
        """(prompt rows, whole trailing_text, buffer update): built once per buffer, then only read."""
        embed = info.get("embed") or {}
        hs = info.get("hidden_states") or {}
        prompt, trailing = embed.get("prefill"), hs.get("trailing_text_all")
        if isinstance(prompt, torch.Tensor) and isinstance(trailing, torch.Tensor):
            return prompt, trailing, {}
        task_type = (info.get("task_type") or ["CustomVoice"])[0]
        prompt, trailing, ref_code_len, ref_code = self._prompt_builder.build_prompt_embeds(
            task_type=task_type, info_dict=info)
        prompt, trailing = prompt.detach().contiguous(), trailing.detach().contiguous()
        update: dict[str, Any] = {"embed": {"prefill": prompt}, "hidden_states": {"trailing_text_all": trailing}}
        if isinstance(ref_code, torch.Tensor) and ref_code.numel() > 0:
            update["codes"] = {"ref": ref_code.detach().contiguous()}
        if ref_code_len is not None:
            update["meta"] = {"ref_code_len": int(ref_code_len)}
        return prompt, trailing, update

    def _fix_pad(self, device: torch.device) -> torch.Tensor:
        return self._tts_pad_embed.to(device=device, dtype=self._embedding_dtype).reshape(1, -1)

    def _fix_text_rows(self, trailing: torch.Tensor, k: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``trailing_text[k]`` per decode index ``k`` (``tts_pad`` past the queue)."""
        pad = self._fix_pad(device)
        rows = pad.expand(k.shape[0], -1).clone()
        inside = k < trailing.shape[0]
        if bool(inside.any()):
            rows[inside] = trailing.to(device=device, dtype=rows.dtype)[k[inside]]
        return rows

    def _fix_meta(self, input_ids: torch.Tensor, decode: bool) -> dict[str, Any]:
        if decode:
            last = input_ids.reshape(-1)[-1]
            valid = ((last >= 0) & (last < self._codebook_vocab_size)).reshape(())
        else:
            valid = torch.zeros((), dtype=torch.bool, device=input_ids.device)
        return {"codec_frame_valid": valid}

    # ------------------------------------------------------------------ the hooks
    def preprocess(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None,
                   **info_dict: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        info = flatten_payload(info_dict)
        n = int(input_ids.shape[0])
        device = input_ids.device
        if n <= 0:
            return input_ids, input_embeds if input_embeds is not None else self.embed_input_ids(input_ids), {}
        c = int(info["_omni_num_computed_tokens"])
        P = int(info["_omni_prompt_len"])
        prompt, trailing, update = self._fix_tables(info, device)
        positions = torch.arange(c, c + n, device=device)
        rows = self._fix_pad(device).expand(n, -1).clone()
        in_prompt = positions < min(P, prompt.shape[0])
        if bool(in_prompt.any()):
            rows[in_prompt] = prompt.to(device=device, dtype=rows.dtype)[positions[in_prompt]]
        generated = positions >= P
        ids_out = input_ids.clone()
        ids_out[~generated] = int(self.talker_config.codec_pad_id)  # the prompt's ids are placeholders
        meta = update.setdefault("meta", {})
        meta.update(self._fix_meta(input_ids, decode=c >= P))
        if c < P:  # the codes Code2Wav reads for prompt positions, as the release publishes them
            update.setdefault("codes", {})["audio"] = torch.zeros(
                (int((~generated).sum()), int(self.talker_config.num_code_groups)), dtype=torch.long, device=device)
        if bool(generated.any()):
            k = positions[generated] - P
            codec = self.embed_input_ids(input_ids[generated].reshape(-1, 1).long()).to(
                device=device, dtype=rows.dtype).reshape(-1, rows.shape[1])
            text = self._fix_text_rows(trailing, k, device)
            if n == 1:  # a decode step: the runner's MTP path adds the text row to the codec row
                last = (info.get("hidden_states") or {}).get("last")
                past = (last.to(device=device, dtype=rows.dtype).reshape(1, -1) if isinstance(last, torch.Tensor)
                        else torch.zeros_like(text))
                update["mtp_inputs"] = (past, text)
                rows = codec
            else:
                rows[generated] = codec + text
        return ids_out, rows, update

    def preprocess_decode_batch(self, *, input_ids: torch.Tensor, req_infos: list[dict[str, Any]],
                                input_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor, torch.Tensor,
                                                                                   list[dict[str, Any]]]:
        ids = input_ids.reshape(-1)
        if int(ids.numel()) != len(req_infos):
            raise ValueError(f"preprocess_decode_batch expected {len(req_infos)} input ids, got {int(ids.numel())}")
        rows, pasts, texts, updates = [], [], [], []
        for i, info in enumerate(req_infos):
            _ids, row, update = self.preprocess(ids[i:i + 1], None, **info)
            past, text = update.pop("mtp_inputs")
            rows.append(row)
            pasts.append(past)
            texts.append(text)
            updates.append(update)
        return ids, torch.cat(rows), torch.cat(pasts), torch.cat(texts), updates
