"""Checks a speaking tiny checkpoint with transformers' own Qwen2.5-Omni code (no vLLM): the rules hold.

``python -m harness.families.qwen2_5_omni.speaking_check MODEL_DIR [--dtype bfloat16]`` (in the real environment)
prints one JSON object. It builds Talker rows the way vLLM-Omni 0.30.0's ``talker_preprocess`` does
(Thinker last hidden states of the prompt; speaker + codec-PAD at ``P-2``; ``thinker_result[0]`` +
codec-BOS at ``P-1``; reply rows + the previous codec id's embedding after it; a text-EOS row at the
end), runs the Thinker and the Talker forward over them, and compares the codec id each position
picks (argmax, and its probability under temperature 0.9 / top-k 40 / top-p 0.8) with
``harness.families.qwen2_5_omni.speaking``'s rules, in four cases:

* ``correct``: the reply is said byte for byte, then the end region: SILENCE at the text-EOS row and
  at the first text-PAD row, codec EOS at the persistent PAD row; and, after a row with no text
  component (what 0.30.0 feeds once its reply queue is empty), codec EOS at once;
* ``end``: the PAD rows dropped (codec-only rows after text-EOS): SILENCE at text-EOS, then codec EOS
  one position early (issue 32: the end region is heard);
* ``no_bos``: the start rows are prompt rows (main's chunked prefill): babble, then EOS;
* ``replay``: after reply token ``k`` was said, its KV entry is rewritten with a prompt row (what a
  replay that delivers the wrong row does): the *next* position, whose own row is correct, now emits
  a different id (memory through attention), and the listener loses that word;
* ``long``: the correct case pushed to positions past 1900 (the stress deploy's longest requests).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from harness.families.qwen2_5_omni import speaking
from harness.speaking.selfcheck import check_main, top_prob

PROMPT = "<|im_start|>system\nYou are Qwen, a helpful voice assistant.<|im_end|>\n<|im_start|>user\n" \
         "How do I make a cup of green tea?<|im_end|>\n<|im_start|>assistant\n"
REPLY = "Heat the water until it is hot, then wait two minutes."
CODEC_PAD, CODEC_BOS, SPEAKER, TEXT_EOS, TEXT_PAD = 8292, 8293, 151872, 151861, 151859


def run(model_dir: Path, dtype_name: str = "bfloat16") -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, Qwen2_5OmniForConditionalGeneration

    dtype = getattr(torch, dtype_name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    thinker, talker = model.thinker, model.talker
    prompt_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    reply_ids = tok(REPLY, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ids = torch.tensor([prompt_ids + reply_ids])
        hidden = thinker.model(input_ids=ids).last_hidden_state[0]  # post-norm, as vLLM ships it
        prompt_h, reply_h = hidden[: len(prompt_ids)], hidden[len(prompt_ids):]
        t_emb = thinker.model.get_input_embeddings()
        c_emb = talker.model.get_input_embeddings()

        def codec(i: int) -> Any:
            return c_emb(torch.tensor([i]))[0]

        spk = t_emb(torch.tensor([SPEAKER]))[0] + codec(CODEC_PAD)
        start = reply_h[0] + codec(CODEC_BOS)
        eos_row = t_emb(torch.tensor([TEXT_EOS]))[0]
        pad_row = t_emb(torch.tensor([TEXT_PAD]))[0]
        P = len(prompt_ids) + 2
        want = speaking.encode_reply(REPLY)  # the bytes, then SILENCE at text-EOS and at the first PAD
        bytes_said = speaking.encode_reply(REPLY, end=False)
        EOS, SIL = speaking.CODEC_EOS, speaking.SILENCE

        def talk(rows: list[Any], offset: int = 0) -> tuple[list[int], list[float]]:
            x = torch.stack(rows).unsqueeze(0).to(dtype)
            t_model = talker.to(dtype)
            emb = t_model.thinker_to_talker_proj(x)
            n = emb.shape[1]
            pos = torch.arange(offset, offset + n).view(1, 1, -1).expand(3, 1, -1)
            out = t_model.model(inputs_embeds=emb, position_ids=pos).last_hidden_state
            logits = t_model.codec_head(out)[0].float()
            # vLLM-Omni's bad_word_processor: ids >= 8194 except EOS, and codec BOS, are never sampled
            logits[:, 8194:] = torch.where(torch.arange(logits.shape[1])[8194:] == speaking.CODEC_EOS,
                                           logits[:, 8194:], torch.full_like(logits[:, 8194:], -1e9))
            logits[:, CODEC_BOS] = -1e9
            picks = logits[P - 1:].argmax(-1).tolist()
            probs = [top_prob(row, top_k=40, top_p=0.8) for row in logits[P - 1:]]  # the deploy's sampling
            return picks, probs

        def rows_for(reply_rows: list[Any], start_rows: list[Any]) -> list[Any]:
            # reply rows on the previous codec id, then text-EOS, then the persistent text-PAD twice (each
            # on the SILENCE id said before it): the end region a correct request schedules
            decode = [reply_rows[k] + codec(bytes_said[k - 1]) for k in range(1, len(reply_rows))]
            return list(prompt_h) + start_rows + decode + [eos_row + codec(bytes_said[-1]), pad_row + codec(SIL),
                                                           pad_row + codec(SIL)]

        results: dict[str, Any] = {"P": P, "reply": REPLY, "dtype": dtype_name}
        picks, probs = talk(rows_for(list(reply_h), [spk, start]))
        bare_end = rows_for(list(reply_h), [spk, start])[:-2]
        bare_end[-1] = codec(bytes_said[-1])  # 0.30.0's row once its queue is empty: no text component at all
        picks_b, probs_b = talk(bare_end)
        results["correct"] = {"ok": picks == want + [EOS] and picks_b == bytes_said + [EOS],
                              "min_prob": min(probs + probs_b), "said": speaking.decode(picks).text}
        dropped = rows_for(list(reply_h), [spk, start])[:-1]
        dropped[-1] = codec(SIL)  # an arm that drops the PAD rows: the codec embedding alone after text-EOS
        picks_d, probs_d = talk(dropped)
        results["end"] = {"ok": picks_d == bytes_said + [SIL, EOS], "min_prob": min(probs_d),
                          "said": speaking.decode(picks_d).text}
        no_bos = list(prompt_h[: P - 2]) + [prompt_h[0], prompt_h[1]]  # main: prompt rows 0, 1 at P-2, P-1
        picks_nb, probs_nb = talk(no_bos + rows_for(list(reply_h), [spk, start])[P:])
        results["no_bos"] = {"ok": picks_nb == [speaking.BABBLE] * len(bytes_said) + [SIL, SIL, EOS],
                             "min_prob": min(probs_nb), "said": speaking.decode(picks_nb).text}
        # a replay rewrites reply row k's KV entry with a prompt row *after* its token was said: the
        # said tokens up to k are the correct ones; position k+1, whose own row is correct, now reads
        # the wrong row through head 0
        k = 6
        corrupt_rows = rows_for(list(reply_h), [spk, start])
        corrupt_rows[P - 1 + k] = prompt_h[30] + codec(bytes_said[k - 1])
        picks_c, probs_c = talk(corrupt_rows)
        said = want[: k + 1] + picks_c[k + 1:]
        spoken = speaking.decode(said)
        results["replay"] = {
            "position": P - 1 + k,
            "next_changed": picks_c[k + 1] != want[k + 1],
            "next_byte_kept": picks_c[k + 1] % speaking.BYTES == want[k + 1] % speaking.BYTES,
            "rest_unchanged": picks_c[k + 2:] == (want + [EOS])[k + 2:],
            "min_prob": min(probs_c),
            "said": spoken.text,
            "garbled": spoken.garbled,
        }
        far = 1950 - P  # the same request placed so that its positions run past 1950
        picks_l, probs_l = talk(rows_for(list(reply_h), [spk, start]), offset=far)
        results["long"] = {"ok": picks_l == want + [EOS], "min_prob": min(probs_l), "offset": far}
    replay = results["replay"]
    results["ok"] = all(results[c]["ok"] for c in ("correct", "end", "no_bos", "long")) and replay["next_changed"] and \
        replay["rest_unchanged"] and replay["garbled"] == 1 and replay["said"] != REPLY
    return results


def main(argv: list[str] | None = None) -> int:
    return check_main(argv, "python -m harness.families.qwen2_5_omni.speaking_check", run)


if __name__ == "__main__":
    sys.exit(main())
