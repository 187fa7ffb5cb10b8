"""Building a tiny checkpoint: the file handling every family's builder shares (``harness.families.<family>.tiny_model``).

A builder runs in the real environment's interpreter (``omni-stress tiny-model`` starts it through
``Family.tiny_model_argv``): it refuses a folder that is not empty (:func:`fresh_folder`) and an environment without the
model's classes (:func:`needs`), writes its
config and weights (:func:`write_json`, :func:`save_state`), a byte-level tokenizer with Qwen's
special tokens on their real ids (:func:`byte_level_tokenizer`) and last the marker
:data:`MARKER` with its summary (:func:`write_marker`), by which the real backend knows a speaking
checkpoint (``harness.serve.backend.is_speaking_checkpoint``). :func:`builder_main` is its command line.

Only the standard library and ``harness.errors`` at import (torch, tokenizers, transformers and
safetensors inside the functions).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from harness.errors import UserError

MARKER = "omni_stress_tiny_model.json"  # the build's summary; {"speaking": true} marks a speaking checkpoint


def fresh_folder(out: Path) -> Path:
    """``out`` as a Path, refused (``UserError``) when it exists and is not empty."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"tiny-model: {out} exists and is not empty (give a new folder)")
    return out


@contextmanager
def needs(what: str) -> Iterator[None]:
    """The builder's imports: an ``ImportError`` inside is one ``UserError`` line, ``what`` and the error."""
    try:
        yield
    except ImportError as exc:
        raise UserError(f"{what} ({exc})") from None


def write_json(path: Path, data: dict[str, Any], sort_keys: bool = True) -> None:
    """A config file: two-space indented JSON and a newline."""
    path.write_text(json.dumps(data, indent=2, sort_keys=sort_keys) + "\n", encoding="utf-8")


def save_state(state: dict[str, Any], path: Path) -> None:
    """Tensors by name, in name order, as safetensors."""
    from safetensors.torch import save_file

    save_file({k: state[k].contiguous() for k in sorted(state)}, str(path), metadata={"format": "pt"})


def folder_bytes(out: Path) -> int:
    """The size of every file below ``out``."""
    return sum(f.stat().st_size for f in out.rglob("*") if f.is_file())


def write_marker(out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """The build's last file, :data:`MARKER` in ``out``: ``summary`` in its own key order; returns it."""
    write_json(out / MARKER, summary, sort_keys=False)
    return summary


def byte_level_tokenizer(vocab: dict[str, int], added: Sequence[tuple[str, int, bool]], *, as_special: bool,
                         model_max_length: int, **fast: Any) -> Any:
    """A byte-level BPE tokenizer with no merges (one token per byte) over ``vocab`` (each byte's GPT-2
    character and its id), padded with ``<|unused_N|>`` tokens up to the first added id, then ``added`` in
    order: ``(text, the id it must get, special)``, each added as a special token (``as_special``) or a
    token; ChatML's EOS and PAD; ``fast``: more ``PreTrainedTokenizerFast`` arguments."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(vocab)
    first = min(want for _, want, _ in added)
    for i in range(len(vocab), first):  # unused ids up to the first special token
        vocab[f"<|unused_{i}|>"] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    for text, want, special in added:
        token = AddedToken(text, special=special, normalized=False)
        if as_special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        got = tok.token_to_id(text)
        if got != want:
            raise RuntimeError(f"tiny tokenizer: {text} got id {got}, want {want}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, model_max_length=model_max_length, **fast)


def builder_main(argv: list[str] | None, prog: str, build: Callable[..., dict[str, Any]],
                 flags: Sequence[str] = ()) -> int:
    """``python -m PROG DIR [--seed N] [--FLAG ...]``: ``build(Path(DIR), seed, *flags' values)``, its
    summary printed as one JSON line; a ``UserError`` is one line on stderr and exit 2."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("out")
    parser.add_argument("--seed", type=int, default=0)
    for flag in flags:
        parser.add_argument(f"--{flag}", action="store_true")
    args = parser.parse_args(argv)
    try:
        summary = build(Path(args.out), args.seed, *(getattr(args, flag) for flag in flags))
    except UserError as exc:
        print(f"omni-stress: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, sort_keys=True))
    return 0
