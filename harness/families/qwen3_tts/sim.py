"""Qwen3-TTS on the sim: its requests, its stand-in model, its runner path, its Talker's start rule
and its contract over the sim's row identities.

What the sim models (docs/simulation.md "Qwen3-TTS"):

* **Requests**: no Thinker; each prompt's ``text`` is tokenised by the sim's rule
  (``harness.tokenizer``) into ``T`` text tokens, one registered text row each. All requests reach
  the Talker when sent (``sim.thinker_steps_per_token: 0`` in the family's deploys).
* **The prompt builder** (``_PromptBuilder``): the release's ``build_prompt_embeds`` layout in the
  streaming-text mode (``non_streaming_mode: false``, the layout that feeds text one row per
  decode step), built from the sim's rows: ``P = 9`` prompt rows and a ``trailing_text`` queue of
  ``T`` rows (``harness.families.qwen3_tts.contract``). The release's builder tokenises the text and
  runs the speaker encoder; the sim's returns the request's registered rows, so what an arm is
  judged on is how ``preprocess`` slices, queues and places them.
* **The runner path** (``TTSRunner``): vLLM-Omni 0.30.0's ``_preprocess`` for a model with
  ``preprocess_decode_batch`` and ``talker_mtp``: a one-token decode span goes through the batched
  hook (a batch of one) and runs with its codec row plus the ``text_step`` row the hook returns;
  every other span calls ``preprocess``. V1 keeps a preempted request's buffer, MRV2
  (``talker.model_runner: v2``) rebuilds it from the payload (``SimRunner.resumed``).
* **The Talker** (``harness.sim.talker.SimTalker``, the words Talker's rules unchanged) with
  Qwen3-TTS's start rows (``TTSKV``): it speaks only if positions ``P-3 .. P-1`` hold ``tts_pad`` +
  the request's speaker codec, ``tts_bos`` + codec PAD, and this request's first text token +
  codec BOS; then codec token ``g`` speaks the text row at ``P - 1 + floor(g / R)`` (text token
  ``j`` sits at ``P - 1 + j``: the first in the prompt, the rest in the decode positions' text
  steps), and ``tts_eos`` / ``tts_pad`` end it. ``R`` is Qwen3-TTS's (``harness.physics``).

* **The speaking Talker** (``--sim-talker speaking``, ``_speaking_cell``): the speaking tiny Qwen3-TTS's
  rules (``harness.families.qwen3_tts.speaking``) over the rows each KV position holds when it is read
  (``harness.sim.speaking_talker``), with the tiny tokenizer's rows (one per text byte; the role header's
  ``\\n`` carries its byte), the checkpoint's codec ids as the sampled codes (speech ids below 2048, BABBLE,
  SILENCE, codec EOS 2150 as the stop token) and ``speaking.decode`` as the oracle transcript.

Codec ids of the prompt rows are the sim's codec vocabulary (``harness.sim.codec``: PAD 8292, BOS 8293,
EOS 8294), not Qwen3-TTS's (2148-2150); the think and speaker ids below are the sim's too. Only their
distinctness matters to the rows (the speaking Talker reads only whether a codec part is BOS).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from harness.config import Deploy, Prompt, PromptSet, SamplingSettings
from harness.contract import misaligned_regions
from harness.errors import ConfigError, UserError
from harness.families.qwen3_tts.contract import DEFAULT_SPEAKER, PROMPT_LEN, ROLE_ROWS, SPEAKER_POS
from harness.sim import armcall
from harness.sim.cell import SimCell
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, CodecVocab, collapse, oracle_transcript
from harness.sim.rows import CODEC_VOCAB, DIM, NONE, RowSpace
from harness.sim.runner import SimRunner
from harness.sim.talker import SimTalker, TalkerKV
from harness.tokenizer import tokenize

CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 8300, 8301, 8302
# CustomVoice speakers (Qwen3-TTS-12Hz-*-CustomVoice's ``spk_id`` names); the ids are the sim's
SPEAKER_CODECS = {"vivian": 8310, "serena": 8311, "uncle_fu": 8312, "dylan": 8313, "eric": 8314,
                  "ryan": 8315, "aiden": 8316, "ono_anna": 8317, "sohee": 8318}
# Base voices (a prompt's ``speaker_embedding``): the release puts the x-vector itself in the speaker's row; the
# sim gives each distinct vector of a prompt set a codec id of its own, in the order the set first names it, so
# the row identities tell one voice from another as they do a CustomVoice speaker's
XVECTOR_CODEC_FIRST = 8320
MAX_XVECTORS = CODEC_VOCAB - XVECTOR_CODEC_FIRST  # 128: the codec table's ids past the speakers
NUM_CODE_GROUPS = 16  # Qwen3-TTS-Tokenizer-12Hz: 16 codebooks per frame


@dataclass
class Specials:
    """The request-independent text rows (registered once per cell): the role header and the tts tokens."""

    role: torch.Tensor  # [3, DIM]
    pad: torch.Tensor  # [1, DIM] tts_pad
    bos: torch.Tensor  # [1, DIM] tts_bos
    eos: torch.Tensor  # [1, DIM] tts_eos
    role_first_id: int
    pad_id: int
    bos_id: int
    eos_id: int

    @classmethod
    def make(cls, space: RowSpace, role_words: tuple[str | None, ...] = (None,) * ROLE_ROWS) -> Specials:
        """``role_words``: what the role header's rows say (the ``speaking`` Talker hears its ``\\n`` row's byte)."""
        role, role_first = space.make("role", list(role_words), None)
        pad, pad_id = space.make("text_pad", [None], None)  # the Talker's END class: tts_pad ends speech
        bos, bos_id = space.make("text_bos", [None], None)
        eos, eos_id = space.make("text_eos", [None], None)
        return cls(role, pad, bos, eos, role_first, pad_id, bos_id, eos_id)


@dataclass
class TTSRequest:
    """One request's input to the Talker (``harness.sim.cell.SimRequest``)."""

    prompt: Prompt
    request_id: str
    reply_tokens: list[str]  # the text's tokens (Arrivals reads their count)
    speaker: str
    text_first_id: int  # registry id of the text's first token row
    prompt_rows: torch.Tensor  # [P, DIM] what build_prompt_embeds returns as the prompt
    trailing_rows: torch.Tensor  # [T, DIM] its trailing_text queue
    prompt_text_ids: np.ndarray  # [P] the prompt rows' identities
    prompt_codec_ids: np.ndarray  # [P]
    arrival_step: int = 0
    voice_codec: int = NONE  # the codec id of the speaker's row: a CustomVoice speaker's or a Base x-vector's
    x_vector: tuple[float, ...] | None = None  # a Base request's speaker embedding (None: CustomVoice)

    @property
    def T(self) -> int:  # noqa: N802 -- the contract's name
        return len(self.reply_tokens)

    @property
    def P(self) -> int:  # noqa: N802
        return int(self.prompt_rows.shape[0])

    @property
    def talker_prompt_ids(self) -> list[int]:
        """The scheduler's placeholder prompt: ``P`` codec-PAD ids (the rows come from the builder)."""
        return [CODEC_PAD] * self.P

    @property
    def reference_text(self) -> str:
        return self.prompt.reply

    def payload(self, token_ids: dict[str, int]) -> dict:
        """What the serving layer puts in the request's buffer (``additional_information``, flattened), plus
        ``hidden_states.last``, which the real Talker's postprocess writes after every forward (the last
        hidden row, the code predictor's input): the sim's Talker has no hidden state, so a zero row (the
        release zero-fills a missing one itself, with a warning). A Base request's voice is what the release's
        serving layer makes of the API's ``speaker_embedding``: ``voice_clone_prompt.ref_spk_embedding`` (a plain
        float list) and ``x_vector_only_mode``."""
        if self.x_vector is not None:
            voice: dict[str, Any] = {"task_type": ["Base"], "voice_clone_prompt": [{"ref_spk_embedding":
                                                                                 list(self.x_vector)}],
                                     "x_vector_only_mode": [True]}
        else:
            voice = {"task_type": ["CustomVoice"], "speaker": [self.speaker]}
        return {"text": [self.prompt.reply], **voice,
                "language": ["Auto"], "non_streaming_mode": [False], "hidden_states": {"last": torch.zeros(1, DIM)}}


def xvector_codecs(prompts: PromptSet) -> dict[tuple[float, ...], int]:
    """Each distinct Base voice of the set (its prompts' ``speaker_embedding``) and the sim's codec id for it."""
    ids: dict[tuple[float, ...], int] = {}
    for prompt in prompts.prompts:
        if prompt.speaker_embedding is not None and prompt.speaker_embedding not in ids:
            ids[prompt.speaker_embedding] = XVECTOR_CODEC_FIRST + len(ids)
    if len(ids) > MAX_XVECTORS:
        raise ConfigError(f"{prompts.path}: {len(ids)} distinct speaker embeddings; the sim tells at most "
                          f"{MAX_XVECTORS} Base voices apart in one prompt set")
    return ids


def make_requests(prompts: PromptSet, space: RowSpace, specials: Specials,
                  tokenizer: Callable[[str], list[str]] = tokenize) -> list[TTSRequest]:
    """``tokenizer``: the sim's rule (``words``) or the speaking checkpoint's bytes (:func:`byte_tokens`)."""
    out = []
    xvectors = xvector_codecs(prompts)
    for prompt in prompts.prompts:
        rid = prompt.id
        tokens = tokenizer(prompt.reply)
        if not tokens:
            raise UserError(f"{prompts.path}: prompt {rid!r}: the text has no tokens")
        text_rows, first = space.make("output", list(tokens), rid)
        if prompt.speaker_embedding is not None:
            speaker, spk = "", xvectors[prompt.speaker_embedding]
        else:
            speaker = prompt.speaker or DEFAULT_SPEAKER
            spk = SPEAKER_CODECS[speaker.lower()]
        codecs = [NONE] * ROLE_ROWS + [CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS, spk, CODEC_PAD, CODEC_BOS]
        texts = ([specials.role_first_id + i for i in range(ROLE_ROWS)] + [specials.pad_id] * 4
                 + [specials.bos_id, first])
        rows = torch.zeros(PROMPT_LEN, DIM)
        rows[:ROLE_ROWS] = specials.role
        rows[ROLE_ROWS:ROLE_ROWS + 4] = specials.pad
        rows[ROLE_ROWS + 4] = specials.bos[0]
        rows[ROLE_ROWS + 5] = text_rows[0]
        rows[ROLE_ROWS:] += space.embed_codec(torch.tensor(codecs[ROLE_ROWS:], dtype=torch.long))
        trailing = torch.cat([text_rows[1:], specials.eos])
        out.append(TTSRequest(prompt, rid, list(tokens), speaker, first, rows, trailing,
                              np.array(texts, dtype=np.int64), np.array(codecs, dtype=np.int64),
                              voice_codec=spk, x_vector=prompt.speaker_embedding))
    return out


class _PromptBuilder:
    """``Qwen3TTSPromptEmbedsBuilder.build_prompt_embeds`` over the sim's rows: the request's prompt
    rows and ``trailing_text`` queue (new tensors each call, as the release's builder makes them)."""

    def __init__(self, requests: list[TTSRequest], space: RowSpace, specials: Specials) -> None:
        self._by_id = {r.request_id: r for r in requests}
        self._by_text = {r.prompt.reply: r for r in requests}
        self._xvectors = {r.x_vector: r.voice_codec for r in requests if r.x_vector is not None}
        self._space = space
        self._pad = specials.pad[0]

    def build_prompt_embeds(self, *, task_type: str, info_dict: dict[str, Any]) -> tuple[Any, Any, None, None]:
        """The request's rows, its speaker row made from the payload's voice, whichever request's payload it is: a
        CustomVoice ``speaker`` (the release reads ``talker_config.spk_id[speaker.lower()]``) or, for ``task_type``
        Base, ``voice_clone_prompt.ref_spk_embedding`` (the release puts the vector itself in the row)."""
        req = self._by_id.get(info_dict.get("request_id"))  # type: ignore[arg-type]
        if req is None:
            text = (info_dict.get("text") or [""])[0]
            req = self._by_text.get(text)
            if req is None:
                raise ValueError(f"the sim's prompt builder knows no request with text {text[:40]!r}")
        rows = req.prompt_rows.clone()
        codec = self._voice_codec(task_type, info_dict, req)
        if codec != req.voice_codec:
            rows[SPEAKER_POS] = self._pad + self._space.embed_codec(torch.tensor([codec], dtype=torch.long))[0]
        return rows, req.trailing_rows.clone(), None, None

    def _voice_codec(self, task_type: str, info_dict: dict[str, Any], req: TTSRequest) -> int:
        """The codec id of the voice a payload names, with the release's refusals of a voice it cannot build; a
        CustomVoice payload that names no speaker (an arm's own dict) keeps the request's own."""
        if task_type == "Base":
            clone = info_dict.get("voice_clone_prompt")
            clone = clone[0] if isinstance(clone, list) and clone else clone
            vector = clone.get("ref_spk_embedding") if isinstance(clone, dict) else None
            if vector is None:
                raise ValueError("Base requires `ref_audio`.")  # no embedding: the release reads the reference audio
            key = tuple(float(v) for v in (vector.tolist() if hasattr(vector, "tolist") else vector))
            if key not in self._xvectors:
                raise ValueError(f"the sim's prompt builder knows no speaker embedding of {len(key)} values like this "
                                 "one (only its prompt set's)")
            return self._xvectors[key]
        speaker = str((info_dict.get("speaker") or [req.speaker])[0]).lower().strip()
        if not speaker:
            raise ValueError("CustomVoice requires additional_information.speaker.")
        if speaker not in SPEAKER_CODECS:
            raise ValueError(f"Unsupported speaker: {speaker}")
        return SPEAKER_CODECS[speaker]

    def preprocess_batch(self, *, req_ids: list[str], model_intermediate_buffer: dict[str, dict[str, Any]],
                         device: Any) -> None:
        """The runners' batch hook (the release's ``preprocess_batch`` delegates here): the release's builder
        batches Base voice-clone work only (tokenised reference texts, reference codes); the sim's requests
        are CustomVoice, for which it stores nothing."""

    def preprocess_infos_batch(self, *, req_infos: list[dict[str, Any]], device: Any) -> None:
        """MRV2's form of :meth:`preprocess_batch` (``preprocess_batch_mrv2`` delegates here): the same."""


class Qwen3TTSSimModel:
    """What Qwen3-TTS's ``preprocess`` / ``preprocess_decode_batch`` touch, from the sim's rows; an arm's
    class (the release's methods, the fix, a plugin) is mixed in before it."""

    @classmethod
    def omni_stress_probe(cls) -> Qwen3TTSSimModel:
        """An instance for ``build_mixin`` to read its attributes from."""
        return cls(RowSpace(0))

    def __init__(self, space: RowSpace, specials: Specials | None = None, requests: list[TTSRequest] | None = None,
                 model_runner: str = "v1") -> None:
        specials = specials or Specials.make(space)
        self._space = space
        self._prompt_builder = _PromptBuilder(requests or [], space, specials)
        self._embedding_dtype = torch.float32
        self._tts_pad_embed = specials.pad[0].clone()
        self._codebook_vocab_size = CODEC_PAD  # content codes lie below the specials
        self._use_v2_model_runner = model_runner == "v2"
        self._silence_ban_frames = 0  # the release's default (model_config.silence_ban_frames unset)
        self._req_x_vector_only: dict[str, bool | None] = {}
        self.talker_config = SimpleNamespace(codec_pad_id=CODEC_PAD, codec_bos_id=CODEC_BOS, codec_eos_token_id=CODEC_EOS,
                                             num_code_groups=NUM_CODE_GROUPS)

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self._space.embed_codec(input_ids.long())

    def profile_run(self, num_tokens: int) -> None:
        """Qwen3-TTS keeps no model-level pool for the profile run to size."""


def bind_arm(impl: Any, space: RowSpace, specials: Specials, requests: list[TTSRequest], model_runner: str) -> Any:
    """A fresh stand-in with the arm's class mixed in first (``impl`` from ``harness.families.qwen3_tts.arms``)."""
    if isinstance(impl, type):
        cls = type(f"Sim{impl.__name__}", (impl, Qwen3TTSSimModel), {})
        model = cls.__new__(cls)
        Qwen3TTSSimModel.__init__(model, space, specials, requests, model_runner)
        return model
    model = Qwen3TTSSimModel(space, specials, requests, model_runner)
    model.preprocess = types.MethodType(impl, model)  # type: ignore[attr-defined]
    return model


class TTSRunner(SimRunner):
    """vLLM-Omni 0.30.0's runner around Qwen3-TTS's hooks (gpu_model_runner.py l.1760-1925; the batch hooks
    and their order per model runner: ``harness.sim.hooks``)."""

    text_step_added = True  # the talker_mtp path: a decode position runs with its codec row + text_step

    def __init__(self, model: Any, space: RowSpace, cell: tuple[str, str, int], contract: Any,
                 kind: str = "v1") -> None:
        super().__init__(model, space, cell, contract, kind)
        # a span starts from the stand-in's embeddings of its ids (the codec table), or an arm's own embed_input_ids
        if type(model).embed_input_ids is Qwen3TTSSimModel.embed_input_ids:
            self._embed = space.embed_numpy
        else:
            self._embed = lambda ids: model.embed_input_ids(torch.from_numpy(ids))

    def invoke_span(self, span_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_infos: dict[str, Any],
                    is_prefill: bool, n: int) -> Any:
        model = self.model
        if n == 1 and not is_prefill:  # no batched decode hook: preprocess's mtp_inputs, the text step added
            return armcall.call(_decode_scalar, hook=model.preprocess, span_ids=span_ids,
                                inputs_embeds=inputs_embeds, req_infos=req_infos, sink=self._past)
        return armcall.call(model.preprocess, input_ids=span_ids, input_embeds=inputs_embeds, **req_infos)


def _decode_scalar(hook: Any, span_ids: torch.Tensor, inputs_embeds: torch.Tensor,
                   req_infos: dict[str, Any], sink: list[Any]) -> tuple[Any, Any, Any]:
    """A model without the batched hook: ``preprocess`` returns ``mtp_inputs`` in its update, which the
    runner pops (l.1899-1905); the MTP forward then runs the position with the text step added, and the
    code predictor with the past hidden state (to ``sink``)."""
    ids, rows, update = hook(input_ids=span_ids, input_embeds=inputs_embeds, **req_infos)
    past_hidden, text_step = update.pop("mtp_inputs")
    sink.append(past_hidden)
    return ids, rows.reshape(1, -1) + text_step.reshape(1, -1).to(rows.dtype), update


@dataclass
class TTSKV(TalkerKV):
    """The Talker's KV with Qwen3-TTS's start rows: ``spk_id`` is the speaker's codec id,
    ``out0_id`` the request's first text row."""

    pad_id: int = NONE
    bos_id: int = NONE

    def _check_started(self) -> bool:
        P, text, codec = self.P, self._text_np, self._codec_np
        return bool(self.length >= P and text[P - 3] == self.pad_id and codec[P - 3] == self.spk_id
                    and text[P - 2] == self.bos_id and codec[P - 2] == CODEC_PAD
                    and text[P - 1] == self.out0_id and codec[P - 1] == CODEC_BOS)


class TTSContract:
    """``harness.families.qwen3_tts.contract`` as array arithmetic over row identities."""

    def __init__(self, specials: Specials, kv_class: type[TalkerKV] = TTSKV,
                 requests: list[TTSRequest] | None = None) -> None:
        """``kv_class``: the words Talker's ``TTSKV`` (its start rows) or the speaking Talker's ``SpeakingKV``.
        ``requests``: the cell's, whose voices :meth:`foreign_voice` knows."""
        self.pad_id, self.bos_id, self.eos_id = specials.pad_id, specials.bos_id, specials.eos_id
        self.kv_class = kv_class
        voices = {r.voice_codec for r in requests or []}
        self._voices = np.array(sorted(voices), dtype=np.int64)

    def foreign_voice(self, out: TTSRequest, codec_ids: np.ndarray) -> np.ndarray:
        """Which of a span's positions hold another request's voice: a speaker codec of the cell that is not
        this request's (the upstream class #4370, a request conditioned on another's voice). A speaker codec no
        request of the cell has is misaligned only: nobody's. A contract made without the cell's requests
        (Qwen3-Omni's, whose prompts take no voice) knows no voices: none is another's."""
        if not self._voices.size:
            return np.zeros(len(codec_ids), dtype=bool)
        return np.isin(codec_ids, self._voices) & (codec_ids != out.voice_codec)

    def text_len(self, out: TTSRequest) -> int:
        """The text rows after the prompt up to ``tts_eos`` (``misaligned_regions``' ``reply_len``)."""
        return out.T - 1

    def new_kv(self, out: TTSRequest, capacity: int) -> TalkerKV:
        spk = out.voice_codec
        if self.kv_class is TTSKV:
            return TTSKV(out.request_id, out.P, spk, out.text_first_id, capacity, pad_id=self.pad_id, bos_id=self.bos_id)
        return self.kv_class(out.request_id, out.P, spk, out.text_first_id, capacity)

    def misaligned_one(self, kv: TTSKV, out: TTSRequest, span_id: int, c: int, t_id: int,
                       k_id: int) -> tuple[int, int]:
        P, T = out.P, out.T
        if c >= P:
            k = c - P
            want = out.text_first_id + 1 + k if k < T - 1 else self.eos_id if k == T - 1 else self.pad_id
            bad = int(t_id != want or k_id != span_id)
            return (bad, 0) if k < T else (0, bad)
        exp_text, exp_codec = self.expected_ids(kv, out, np.array((span_id,), dtype=np.int64), c, 1)
        return int(int(exp_text[0]) != t_id or int(exp_codec[0]) != k_id), 0

    def misaligned(self, kv: TTSKV, out: TTSRequest, span_ids: np.ndarray, c: int, n: int,
                   text_ids: np.ndarray, codec_ids: np.ndarray) -> tuple[int, int]:
        exp_text, exp_codec = self.expected_ids(kv, out, span_ids, c, n)
        wrong = (exp_text != text_ids) | (exp_codec != codec_ids)
        return misaligned_regions(np.flatnonzero(wrong) + c, out.P, out.T - 1)

    def expected_ids(self, kv: TTSKV, out: TTSRequest, span_ids: np.ndarray, c: int,
                     n: int) -> tuple[np.ndarray, np.ndarray]:
        P, T = out.P, out.T
        p = np.arange(c, c + n)
        k = p - P
        prompt = p < P
        q = np.minimum(p, P - 1)
        exp_text = np.where(prompt, out.prompt_text_ids[q],
                            np.select([k < T - 1, k == T - 1], [out.text_first_id + 1 + k, self.eos_id], self.pad_id))
        exp_codec = np.where(prompt, out.prompt_codec_ids[q], span_ids)
        return exp_text, exp_codec


def build_cell(impl: Any, deploy: Deploy, prompts: PromptSet, seed: int, talker_mode: str) -> SimCell:
    """``talker_mode``: ``words`` (the words Talker with Qwen3-TTS's start rows) or ``speaking`` (the speaking
    tiny Qwen3-TTS's rules, ``harness.families.qwen3_tts.speaking``, and its tokenizer: one row per byte)."""
    if talker_mode not in ("words", "speaking"):
        raise UserError(f"--sim-talker {talker_mode!r}: unknown sim Talker for qwen3-tts (choose words or speaking)")
    space = RowSpace(seed)
    if talker_mode == "speaking":
        return _speaking_cell(impl, deploy, prompts, space)
    specials = Specials.make(space)
    requests = make_requests(prompts, space, specials)
    model = bind_arm(impl, space, specials, requests, deploy.talker.model_runner)
    frames = deploy.sim.frames_per_text_token
    vocab = CodecVocab.build(t for r in requests for t in r.reply_tokens)
    sampling = SamplingSettings(**{**deploy.sampling.__dict__, "seed": seed})
    talker = SimTalker(space, vocab, sampling, frames)
    talker.freeze()

    def speak(codes: list[int]) -> tuple[list[int], str, list[str]]:
        units = collapse(codes, vocab, frames)
        return codes, oracle_transcript(units), units

    return SimCell(requests=requests, token_ids={}, space=space, model=model, talker=talker,
                   contract=TTSContract(specials, requests=requests), stop_token_ids=[CODEC_EOS], speak=speak,
                   runner_class=TTSRunner)


SPEAKING_ROLE_WORDS = ("<|im_start|>", "assistant", "\n")  # the tiny tokenizer's role header: \n is a byte


def byte_tokens(text: str) -> list[str]:
    """The speaking checkpoint's tokens of a text (one per UTF-8 byte, ``harness.tokenizer.token_byte`` reads them)."""
    from harness.families.qwen3_tts import speaking

    return [chr(b) for b in speaking.text_token_ids(text)]


def _speaking_cell(impl: Any, deploy: Deploy, prompts: PromptSet, space: RowSpace) -> SimCell:
    """The ``speaking`` Talker's cell: rows made from the tiny tokenizer's bytes, the Talker following
    ``speaking.next_code`` over the rows each KV position holds now (a replay's rewrite included,
    ``SpeakingKV``), the codec stream read back by ``speaking.decode`` (the real backend's oracle)."""
    from harness.families.qwen3_tts import speaking
    from harness.sim.speaking_talker import SpeakingKV, speaking_parts

    specials = Specials.make(space, SPEAKING_ROLE_WORDS)
    requests = make_requests(prompts, space, specials, byte_tokens)
    model = bind_arm(impl, space, specials, requests, deploy.talker.model_runner)
    frames = deploy.sim.frames_per_text_token
    talker, speak = speaking_parts(space, speaking, frames, byte_kinds=("output", "role"))

    return SimCell(requests=requests, token_ids={}, space=space, model=model, talker=talker,
                   contract=TTSContract(specials, SpeakingKV, requests), stop_token_ids=[speaking.CODEC_EOS],
                   speak=speak, runner_class=TTSRunner)


def check_prompts(prompts: PromptSet, talker_mode: str) -> None:
    """``words``: the words Talker says each text's tokens as it says a reply: the same check (``check_words``).
    ``speaking``: every text must be one the tiny tokenizer turns into one token per byte (``check_text``)."""
    if talker_mode == "speaking":
        from harness.families.qwen3_tts.speaking import check_text

        for i, prompt in enumerate(prompts.prompts):
            try:
                check_text(prompt.reply)
            except ValueError as exc:
                raise ConfigError(f"{prompts.path}: prompts[{i}].text: {exc} (prompt {prompt.id!r}; --sim-talker "
                                  "speaking)") from None
        return
    if talker_mode != "words":
        raise ConfigError(f"--sim-talker {talker_mode}: unknown sim Talker for qwen3-tts (choose words or speaking)")
    from harness.sim.talker import check_words

    check_words(prompts)
