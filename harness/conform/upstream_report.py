"""The report for upstream (issue 22, item 7): per failing cell, the upstream line that decides the row, the
smallest schedule that shows it, the shipped deploy that reaches it, and the related upstream issue.

The line is found, per release, by searching the release's own file for a short anchor (the statement that
routes or slices), so a line that moves between releases is reported where it is in the release checked. A cell
whose model and column have no anchor here says so ("not mapped"), and one whose anchor is missing from the
release says that.

``ISSUES`` names an upstream issue only where the issue text says so:

* **#5018**: vLLM-Omni's "FIX #5018" (the seed experiment) is about choosing prefill or decode from the span length
  ("a chunked-prefill chunk at a non-zero offset received the beginning of the reconstructed prompt; a one-token
  prefill tail was treated as decode; a multi-position decode span ... went to the prefill branch"), and the issue
  lists mimo_audio, moss_tts, voxcpm2, fish_speech, glm_tts and indextts2 as using the same span-length heuristic.
* **#6179**: the restart class, "native-AR TTS that restarts from frame 0 after recompute preemption: Gepard,
  VoxCPM2". The restart column of other models is the same class (a generated position re-receives the start
  conditioning after a replay); the entry says that #6179 does not name them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

QWEN25 = "vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py"
QWEN3_OMNI = "vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py"
QWEN3_TTS = "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py"
MINICPMO = "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_tts.py"
MOSS = "vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_talker.py"
FISH = "vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py"
GEPARD = "vllm_omni/model_executor/models/gepard/gepard_talker.py"

_Q25_ROUTE = (QWEN25, "        if span_len > 1:", "talker_preprocess routes on the span length: any span of n > 1 "
              "goes to the prefill branch, which rebuilds the prompt from row 0 and returns all P rows; n == 1 decodes")
_Q3O_PREFILL = (QWEN3_OMNI, "req_input_ids, req_embeds, trailing_text_hidden = self._thinker_to_talker_prefill(",
                "a replay span crossing P is a prefill slice of the P prompt rows: it returns the rows up to P only, "
                "and the trailing_text queue is set again from its head")
_Q3T_OFFSET = (QWEN3_TTS, 'offset = max(0, int(meta.get("talker_prefill_offset", 0) or 0))',
               "the stored prompt is sliced at talker_prefill_offset, the hook's own counter, which a preemption "
               "does not reset (V1 keeps the buffer)")
_MOSS_ROUTE = (MOSS, "if span_len > 1 or is_first_call:", "preprocess routes on the span length: a one-token span "
               "after the first call decodes (the previous frame's audio), a span of n > 1 re-initialises as a prefill")
_FISH_ROUTE = (FISH, "        if span_len > 1:", "preprocess routes on the span length: a one-token span decodes "
               "(its placeholder id's embedding), a span of n > 1 is a prefill")
_FISH_FIRST = (FISH, "take = prompt_embeds_buf[:span_len]", "a prefill-routed span after the prompt was dropped "
               "builds it again and takes its rows from row 0, whatever the offset")
_FISH_PAD = (FISH, "pad_n = span_len - int(take.shape[0])", "a replay slices the prompt at meta.prefill_offset and pads "
             "past its end with <|audio_pad|> rows, so generated positions in the replay span lose their own rows")
_GEPARD_PREFILL = (GEPARD, "embeds = self.model.embed_input_ids(input_ids)", "a replay is a prefill by the runner's "
                   "metadata: generated positions get their head0 id's embedding, not the 32-code frame embedding")

ANCHORS: dict[tuple[str, str], tuple[str, str, str]] = {
    **{("qwen2.5-omni", k): _Q25_ROUTE for k in ("chunk", "tail", "multi_decode", "cross_replay", "repeated_replay",
                                                 "row_count", "restart", "vllm:stress")},
    ("qwen3-omni", "multi_decode"): (QWEN3_OMNI, "    def talker_preprocess_decode(", "a decode span of n > 1 gets no "
                                     "text_step: the decode path and the runner's MTP are for one position"),
    # (qwen3-omni@async's chunk and tail cells come from cached_decode indexing on the streamed path: not mapped)
    **{("qwen3-omni", k): _Q3O_PREFILL for k in ("cross_replay", "repeated_replay", "row_count", "vllm:stress")},
    ("qwen3-omni", "restart"): (QWEN3_OMNI, "# Queue trailing_text_hidden for decode", "the prefill queues "
                                "trailing_text again from its head: decode restarts at Thinker text row 0"),
    **{("qwen3-tts", k): _Q3T_OFFSET for k in ("cross_replay", "repeated_replay", "restart", "vllm:stress")},
    ("minicpmo-4.5", "multi_decode"): (MINICPMO, "dtype=torch.long).reshape(-1)[-1:]", "a decode call embeds only the span's last id"),
    **{("minicpmo-4.5", k): (MINICPMO, "MiniCPM-o Talker prefill span exceeds condition", "a replay span past the P "
                             "condition rows raises ValueError, which fails the engine step")
       for k in ("cross_replay", "repeated_replay", "vllm:stress")},
    ("minicpmo-4.5", "row_count"): (MINICPMO, "dtype=torch.long).reshape(-1)[-1:]", "a decode call returns one row for any span"),
    ("moss-tts", "tail"): _MOSS_ROUTE,
    ("moss-tts", "multi_decode"): _MOSS_ROUTE,
    **{("moss-tts", k): (MOSS, 'ref_offset = int(info_dict.get("ref_offset", 0))', "the reference-audio codes are "
                         "sliced at ref_offset, a counter each prefill span advances and a preemption never resets")
       for k in ("cross_replay", "repeated_replay", "vllm:stress")},
    ("fish-speech", "tail"): _FISH_ROUTE,
    ("fish-speech", "multi_decode"): _FISH_FIRST,
    **{("fish-speech", k): _FISH_PAD for k in ("cross_replay", "repeated_replay", "vllm:stress")},
    ("gepard", "multi_decode"): (GEPARD, "embeds = curr.to(device=dev).reshape(1, -1)", "a decode span returns one "
                                 "row (curr_embed_for_next) for any n; the runner leaves the rest as they were"),
    ("gepard", "row_count"): (GEPARD, "embeds = curr.to(device=dev).reshape(1, -1)", "a decode span returns one row"),
    **{("gepard", k): _GEPARD_PREFILL for k in ("cross_replay", "repeated_replay", "vllm:stress")},
    ("gepard", "restart"): (GEPARD, "state.frame_count = 0", "a prefill after frames were committed (a recompute) "
                            "clears the frames and restarts from frame 0, as its own comment says"),
}

_SPAN = "span-length routing (upstream #5018: FIX #5018 replaces it for Qwen2.5-Omni)"
_LISTED = "#5018 lists {} as using the same span-length heuristic; this cell comes from its span-length routing"
_RESTART_CLASS = ("the #6179 class (a generated position re-receives the start conditioning after a recompute "
                  "preemption); #6179 names Gepard and VoxCPM2, not this model")
ISSUES: dict[tuple[str, str], tuple[int, str]] = {
    **{("qwen2.5-omni", k): (5018, _SPAN) for k in ("chunk", "tail", "multi_decode", "cross_replay",
                                                    "repeated_replay", "row_count", "vllm:stress")},
    ("qwen2.5-omni", "restart"): (6179, _RESTART_CLASS),
    ("qwen3-omni", "restart"): (6179, _RESTART_CLASS),
    ("qwen3-tts", "restart"): (6179, _RESTART_CLASS),
    ("moss-tts", "tail"): (5018, _LISTED.format("moss_tts")),
    ("moss-tts", "multi_decode"): (5018, _LISTED.format("moss_tts")),
    ("fish-speech", "tail"): (5018, _LISTED.format("fish_speech")),
    ("fish-speech", "multi_decode"): (5018, _LISTED.format("fish_speech")),
    ("fish-speech", "cross_replay"): (5018, _LISTED.format("fish_speech")),
    ("fish-speech", "repeated_replay"): (5018, _LISTED.format("fish_speech")),
    ("fish-speech", "vllm:stress"): (5018, _LISTED.format("fish_speech")),
    ("gepard", "restart"): (6179, "#6179 names Gepard: a recompute preemption restarts generation from frame 0"),
}


def model_base(row: str) -> str:
    """``qwen3-tts@mrv2`` -> ``qwen3-tts``; the built-in arms and plugin arms have no upstream line."""
    return row.split("@")[0]


def find_line(text: str, snippet: str) -> int | None:
    """1-based line of the first occurrence of ``snippet`` in ``text``."""
    at = text.find(snippet)
    return None if at < 0 else text.count("\n", 0, at) + 1


def schedule_text(trigger: dict[str, Any] | None) -> str:
    """The spans that show the cell: the request's earlier chunks and replays, then the span that differed."""
    if not trigger:
        return ""
    parts, replay = [], 0
    for c, n, r in trigger.get("history", []):
        if r > replay:
            parts.append("preempt")
            replay = r
        parts.append(f"[{c},{c + n})")
    if trigger["replay"] > replay:
        parts.append("preempt")
    parts.append(f"[{trigger['c']},{trigger['c'] + trigger['n']})")
    return f"P={trigger['P']}: " + " -> ".join(parts)


def findings(result: Any, source_text: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """One entry per failing cell of ``result`` (a ``ModelResult``); ``source_text(member)`` is the release's file."""
    base = model_base(result.model)
    out: list[dict[str, Any]] = []
    texts: dict[str, str | None] = {}
    for key, cell in result.cells.items():
        if cell.status in ("conforms", "not-run"):
            continue
        entry: dict[str, Any] = {"column": key, "cell": cell.summary, "schedule": schedule_text(cell.trigger),
                                 "file": None, "line": None, "why": None, "issue": None, "issue_why": None}
        anchor = ANCHORS.get((base, key))
        if anchor is None:
            entry["why"] = "not mapped"
        else:
            member, snippet, why = anchor
            if member not in texts:
                texts[member] = source_text(member)
            text = texts[member]
            line = None if text is None else find_line(text, snippet)
            entry.update(file=member, line=line, why=why if line else f"{why} (anchor not found in this release)")
        reach = result.reach.cells.get(key) if result.reach is not None else None
        entry["reach"] = reach.text if reach is not None else None
        issue = ISSUES.get((base, key))
        if issue is not None:
            entry["issue"], entry["issue_why"] = issue
        out.append(entry)
    return out


def format_findings(model: str, entries: list[dict[str, Any]]) -> list[str]:
    lines = []
    for e in entries:
        where = f"{e['file'].rsplit('/', 1)[-1]}:{e['line']}" if e["file"] and e["line"] else (e["why"] or "")
        issue = f"; upstream #{e['issue']}" if e["issue"] else ""
        lines.append(f"  upstream: {e['column']} ({e['cell']}): {where}; schedule {e['schedule'] or '-'}"
                     f"; {e['reach'] or 'reach unknown'}{issue}")
    return lines
