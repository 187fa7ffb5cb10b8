"""The self-check harness every speaking checkpoint's ``speaking_check`` runs in (``harness.families.<family>.speaking_check``).

A family's self-check runs its tiny Talker forward over the rows the release would build (and corrupted
variants) and compares the codec id each sampled position picks with the family's rules; what it shares
is how sure the pick is under the deploy's sampling (:func:`top_prob`) and its command line
(:func:`check_main`: one JSON object on stdout, exit 0 when every case holds, 1 when one does not, 2 on
a folder that is no checkpoint).

Only the standard library at import (torch inside the functions).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def top_prob(logits: Any, temperature: float = 0.9, top_k: int = 40, top_p: float | None = None) -> float:
    """Probability of the argmax after vLLM's temperature, top-k and (unless None) top-p: the deploy's sampling."""
    import torch

    vals, _ = torch.topk(logits.float() / temperature, top_k)
    probs = torch.softmax(vals, dim=-1)
    if top_p is None:
        return float(probs[0])
    keep = torch.cumsum(probs, -1) - probs < top_p
    kept = probs[keep]
    return float(kept[0] / kept.sum())


def score_case(logits: Any, kv: Any, first: int, rules: Any, top_k: int = 50) -> dict[str, Any]:
    """Argmax of ``logits`` vs the rules (``rules.say``) at every sampled position ``m >= first`` of the rule rows
    ``kv``: the positions said wrong (the first five), the smallest margin and top-``k`` probability, what the
    argmax stream reads back as (``rules.decode``). Shared by the Qwen3 families' self-checks."""
    wrong, margins, probs, said = [], [], [], []
    for m in range(first, len(kv)):
        want = rules.say(kv, m)
        row = logits[m]
        got = int(row.argmax())
        other = row.clone()
        other[want] = float("-inf")
        margins.append(float(row[want] - other.max()))
        probs.append(top_prob(row, top_k=top_k))
        if got != want:
            wrong.append({"position": m, "want": want, "got": got})
        said.append(got)
    return {"ok": not wrong, "wrong": wrong[:5], "min_margin": round(min(margins), 3),
            "min_prob": min(probs), "said": rules.decode(said).text}


def check_main(argv: list[str] | None, prog: str, run: Callable[[Path, str], dict[str, Any]],
               refuse: Callable[[Path], str | None] | None = None) -> int:
    """``python -m PROG MODEL_DIR [--dtype bfloat16|float32]``: ``run(MODEL_DIR, dtype)``'s results as one
    JSON line, exit 0 when their ``ok`` holds; ``refuse(MODEL_DIR)``: why the folder is no checkpoint (one
    line on stderr, exit 2), or None."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = parser.parse_args(argv)
    why = refuse(args.model_dir) if refuse is not None else None
    if why is not None:
        print(f"omni-stress: error: {why}", file=sys.stderr)
        return 2
    results = run(args.model_dir, args.dtype)
    print(json.dumps(results, sort_keys=True))
    return 0 if results["ok"] else 1


def summarize(results: dict[str, Any], names: Iterable[str], text: str) -> dict[str, Any]:
    """The verdict over a checkpoint's cases (``results[name]`` from its ``check_case``): the correct rows
    say ``text``, rows without codec BOS say nothing, every case holds; the smallest margin and probability."""
    names = list(names)
    results["correct"]["said_ok"] = results["correct"]["said"] == text
    results["no_bos"]["said_ok"] = results["no_bos"]["said"] == ""
    results["min_margin"] = min(results[c]["min_margin"] for c in names)
    results["min_prob"] = min(results[c]["min_prob"] for c in names)
    results["ok"] = (all(results[c]["ok"] for c in names) and results["correct"]["said_ok"]
                     and results["no_bos"]["said_ok"])
    return results

