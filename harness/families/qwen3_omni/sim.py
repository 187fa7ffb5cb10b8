"""Qwen3-Omni on the sim: the scripted Thinker and its two ways to the Talker, the stand-in model, the
runner path, the Talker's start rule and the contract over the sim's row identities.

What the sim models (docs/families/qwen3_omni.md):

* **The Thinker** says each prompt's scripted ``reply`` after a ChatML prompt (system, user and
  assistant turns, Qwen3-Omni's template ids), one registered row per token (``harness.tokenizer``'s
  word rule), in a row space exact in bfloat16 (``harness.families.qwen3_omni.rows``): the release casts
  every row to bf16. It runs ``thinker.max_num_seqs`` requests at a time, first come first served, one
  token per ``sim.thinker_steps_per_token`` Talker steps (``harness.sim.load``).
* **``async_chunk: false``** (the full payload, ``thinker2talker_full_payload``): the Talker request
  arrives when its Thinker finishes, with every row but the terminal ``<|im_end|>``'s.
* **``async_chunk: true``** (every shipped Qwen3-Omni deploy): the request arrives with chunk 0 (the
  prompt rows and the first reply token's, ``thinker2talker_async_chunk``), after the Thinker's prefill
  and first decode step; reply token ``j >= 1`` streams as its own chunk (``{"embed": {"decode": row},
  "meta": {"finished": j == K-1}}``) when the Thinker has processed it. The connector queues chunks per
  request and the runner merges **one** into the request's buffer before each of its Talker calls after
  the first (the runner's ``_update_intermediate_buffer``), so when the Thinker runs ahead (it does: its
  pace is at most one token per Talker step) chunks wait, and several land during a chunked prefill.
  A Talker that outruns its Thinker waits: the scheduler holds a streamed request whose next chunk has not
  come (``WAITING_FOR_CHUNK``, :meth:`OmniRunner.held`, ``harness.sim.chunkhold``), and a deploy's
  ``sim.chunk_ready_lag`` says how many steps after a call its next chunk can be ready at the earliest.
* **The runner path** (``OmniRunner``): vLLM-Omni 0.30.0's ``_preprocess`` for a model with
  ``talker_mtp``: every span calls ``talker_preprocess``; a one-token decode span runs with its codec
  row plus the ``text_step`` the hook returns in ``mtp_inputs`` (popped by the runner); a longer decode
  span gets no text step. V1 keeps a preempted request's buffer; MRV2 (``talker.model_runner: v2``)
  rebuilds it from the payload (``SimRunner.resumed``), modelled for the full payload only (how MRV2
  rebuilds a resumed request's streamed rows is not known here, as ``conform`` says): MRV2 with
  ``async_chunk: true`` is refused.
* **The Talker** (``harness.sim.talker.SimTalker``, the words Talker's rules unchanged) with the
  Qwen3 start rows (``TTSKV``: Qwen3-Omni's assistant block is the one Qwen3-TTS's builder copies): it
  speaks only if ``P-3 .. P-1`` hold ``tts_pad`` + the speaker's codec, ``tts_bos`` + codec PAD and this
  request's first reply token + codec BOS; codec token ``g`` then speaks the text row at
  ``P - 1 + floor(g / R)``, ``R`` Qwen3's 12.5 Hz codec rate (``harness.physics``).

The stand-in's codec ids are the sim's (PAD 8292, BOS 8293, EOS 8294, think ids 8300-8302, speakers
8320-8322), not Qwen3-Omni's (2148-2150, ...): only their distinctness matters to the rows.
"""

from __future__ import annotations

import heapq
import math
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from harness.config import Deploy, Prompt, PromptSet, SamplingSettings
from harness.errors import ConfigError, UserError
from harness.families.qwen3_omni.contract import ASSISTANT_ROWS, HEADER_ROWS
from harness.families.qwen3_omni.rows import BF16RowSpace
from harness.families.qwen3_tts.sim import TTSContract, TTSKV, _decode_scalar
from harness.sim import armcall
from harness.sim.cell import SimCell
from harness.sim.codec import CODEC_BOS, CODEC_EOS, CODEC_PAD, CodecVocab, collapse, oracle_transcript
from harness.sim.rows import DIM, NONE, RowSpace
from harness.sim.runner import SimRunner
from harness.sim.talker import SimTalker, TalkerKV
from harness.tokenizer import tokenize

# Qwen3-Omni's tokenizer ids of the ChatML template (the release reads them from its config)
IM_START, IM_END, NEWLINE = 151644, 151645, 198
SYSTEM, USER, ASSISTANT = 8948, 872, 77091
TTS_PAD_TOKEN = 151671
AUDIO_TOKEN, IMAGE_TOKEN, VIDEO_TOKEN = 151675, 151655, 151656
WORD_ID_BASE = 1000  # the sim's word token ids: base + index in the cell's vocabulary
CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS = 8300, 8301, 8302
# Qwen3-Omni's speakers (talker_config.speaker_id, lower-cased by the release; the first is its default voice)
SPEAKERS = {"chelsie": 8320, "ethan": 8321, "aiden": 8322}
DEFAULT_SPEAKER = "chelsie"
NUM_CODE_GROUPS = 16


@dataclass
class Specials:
    """The Thinker's embeddings of the TTS tokens (``embed.tts_bos`` / ``tts_eos`` / ``tts_pad``), shared by
    every request of a cell."""

    pad: torch.Tensor  # [1, DIM]
    bos: torch.Tensor
    eos: torch.Tensor
    pad_id: int
    bos_id: int
    eos_id: int

    @classmethod
    def make(cls, space: RowSpace) -> Specials:
        pad, pad_id = space.make("text_pad", [None], None)  # the Talker's END class: tts_pad ends speech
        bos, bos_id = space.make("text_bos", [None], None)
        eos, eos_id = space.make("text_eos", [None], None)
        return cls(pad, bos, eos, pad_id, bos_id, eos_id)


@dataclass
class OmniRequest:
    """One request: the Thinker's tokens and rows, and what reaches the Talker (``harness.sim.cell.SimRequest``)."""

    prompt: Prompt
    request_id: str
    prompt_ids: list[int]  # the Thinker's ChatML prompt
    reply_tokens: list[str]
    reply_ids: list[int]
    rows: torch.Tensor  # [Pt + K, DIM] the Thinker's layer-0 embedding of every token it processed
    hidden: torch.Tensor  # [Pt + K, DIM] its accept-layer hidden states (read only for multimodal tokens)
    output_first_id: int  # registry id of r_0
    user_len: int  # U: the user turn's tokens
    prompt_text_ids: np.ndarray  # [P] the contract's prompt rows (identities)
    prompt_codec_ids: np.ndarray  # [P]
    specials: Specials
    async_chunk: bool
    steps_per_token: float
    speaker: str = DEFAULT_SPEAKER
    arrival_step: int = 0
    thinker_start: int = 0  # the Talker step the Thinker started this request

    @property
    def streams(self) -> bool:
        """``harness.sim.load``: a streamed request reaches the Talker with chunk 0."""
        return self.async_chunk

    @property
    def P(self) -> int:  # noqa: N802 -- the contract's name
        return self.user_len + ASSISTANT_ROWS

    @property
    def T(self) -> int:  # noqa: N802 -- the text rows after the prompt: K (TTSContract's name)
        return len(self.reply_tokens)

    @property
    def text_first_id(self) -> int:  # TTSContract's name for r_0's row
        return self.output_first_id

    @property
    def talker_prompt_ids(self) -> list[int]:
        """``thinker2talker_token_only`` / the async path's placeholder prompt: ``[0] * P``."""
        return [0] * self.P

    @property
    def reference_text(self) -> str:
        return self.prompt.reply

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.reply_ids + [IM_END]

    def _tts_rows(self) -> dict[str, torch.Tensor]:
        s = self.specials
        return {"tts_bos": s.bos.view(1, 1, -1).to(torch.bfloat16), "tts_eos": s.eos.view(1, 1, -1).to(torch.bfloat16),
                "tts_pad": s.pad.view(1, 1, -1).to(torch.bfloat16)}

    def payload(self, token_ids: dict[str, int]) -> dict:
        """The request's buffer when it reaches the Talker, in the Thinker's bf16: the full payload
        (``thinker2talker_full_payload``: every row but the terminal stop token's, ``ids.all`` with it), or
        chunk 0 (``thinker2talker_async_chunk``: the prompt rows and ``r_0``'s, the ids so far)."""
        Pt = len(self.prompt_ids)
        n = Pt + 1 if self.async_chunk else Pt + self.T
        ids_all = self.all_ids[:n] if self.async_chunk else self.all_ids
        return {"embed": {"prefill": self.rows[:n].to(torch.bfloat16), **self._tts_rows()},
                "hidden_states": {"output": self.hidden[:n].to(torch.bfloat16)},
                "ids": {"all": list(ids_all), "prompt": list(self.prompt_ids)},
                "meta": {"finished": torch.tensor(not self.async_chunk or self.T == 1)}}

    def chunk(self, j: int) -> dict:
        """Chunk ``j >= 1`` of the async path: ``r_j``'s row, finished with the last."""
        Pt = len(self.prompt_ids)
        return {"embed": {"decode": self.rows[Pt + j:Pt + j + 1].to(torch.bfloat16)},
                "meta": {"finished": torch.tensor(j == self.T - 1)}}

    def chunk_step(self, j: int) -> int:
        """The Talker step chunk ``j`` is ready: after the Thinker's prefill and ``j + 1`` decode steps."""
        return self.thinker_start + math.ceil((2 + j) * self.steps_per_token)


def byte_tokens(text: str) -> list[str]:
    """The speaking checkpoint's tokens of a text: one per UTF-8 byte (``harness.tokenizer.token_byte`` reads them)."""
    from harness.families.qwen3_omni import speaking

    return [chr(b) for b in speaking.text_token_ids(text)]


def run_thinker(prompts: PromptSet, space: RowSpace, specials: Specials, deploy: Deploy,
                tokenizer: Any = tokenize, newline: str | None = None) -> list[OmniRequest]:
    """The scripted Thinker's requests, with their arrival steps under ``load.mode: all`` (the Thinker's
    ``max_num_seqs`` sequences, first come first served; other loads: ``harness.sim.load.Arrivals``).
    ``tokenizer``: the sim's word rule or the speaking checkpoint's bytes (:func:`byte_tokens`); ``newline``:
    what the template's ``\n`` rows say (the speaking checkpoint's ``\n`` is a byte; the words Talker's silent)."""
    s = deploy.sim.thinker_steps_per_token
    vocab: dict[str, int] = {}

    def words(text: str) -> tuple[list[str], list[int]]:
        toks = tokenizer(text)
        return toks, [vocab.setdefault(t, WORD_ID_BASE + len(vocab)) for t in toks]

    free_at = [0] * max(1, deploy.thinker.max_num_seqs)
    sys_toks, sys_ids = words(prompts.system_prompt or "")
    out = []
    for prompt in prompts.prompts:
        rid = prompt.id
        user_toks, user_ids = words(prompt.user)
        reply_toks, reply_ids = words(prompt.reply)
        if not reply_toks:
            raise UserError(f"{prompts.path}: prompt {rid!r}: the reply has no tokens")
        head = [("<|im_start|>", IM_START), ("system", SYSTEM), ("\n", NEWLINE), *zip(sys_toks, sys_ids),
                ("<|im_end|>", IM_END), ("\n", NEWLINE)]
        user = [("<|im_start|>", IM_START), ("user", USER), ("\n", NEWLINE), *zip(user_toks, user_ids),
                ("<|im_end|>", IM_END), ("\n", NEWLINE)]
        assistant = [("<|im_start|>", IM_START), ("assistant", ASSISTANT), ("\n", NEWLINE)]
        template = head + user + assistant
        # a prompt row speaks its word (the user's words) or is silent (the template tokens)
        spoken = [t if i in range(len(head) + 3, len(head) + 3 + len(user_toks)) else newline if t == "\n" else None
                  for i, (t, _) in enumerate(template)]
        p_rows, p_first = space.make("prompt", spoken, rid)
        o_rows, o_first = space.make("output", list(reply_toks), rid)
        rows = torch.cat([p_rows, o_rows])
        gen = torch.Generator().manual_seed(len(out))
        hidden = torch.randn(rows.shape[0], DIM, generator=gen).to(torch.bfloat16).to(torch.float32)
        U = len(user)
        a = len(head) + U  # the assistant turn's <|im_start|> in the Thinker prompt
        text_ids = ([p_first + len(head) + i for i in range(U)] + [p_first + a + i for i in range(HEADER_ROWS)]
                    + [specials.pad_id] * 4 + [specials.bos_id, o_first])
        codec_ids = ([NONE] * (U + HEADER_ROWS)
                     + [CODEC_NOTHINK, CODEC_THINK_BOS, CODEC_THINK_EOS, SPEAKERS[DEFAULT_SPEAKER], CODEC_PAD, CODEC_BOS])
        start = heapq.heappop(free_at)
        done = start + math.ceil((1 + len(reply_toks)) * s)
        heapq.heappush(free_at, done)
        req = OmniRequest(prompt, rid, [i for _, i in template], list(reply_toks), reply_ids, rows, hidden, o_first, U,
                          np.array(text_ids, dtype=np.int64), np.array(codec_ids, dtype=np.int64), specials,
                          deploy.async_chunk, s)
        req.thinker_start = start
        req.arrival_step = start + math.ceil(2 * s) if deploy.async_chunk else done
        out.append(req)
    return out


class _Projection:
    """``text_projection`` / ``hidden_projection``: the identity (the sim's Thinker and Talker rows share one
    width), a new tensor as an ``nn.Linear`` returns."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class _TalkerModule:
    EMBEDS_CODEC_TABLE = True  # the runner may read ids' rows from the table directly (harness.sim.runner)

    def __init__(self, space: RowSpace) -> None:
        self._space = space
        self.text_projection = _Projection()
        self.hidden_projection = _Projection()
        self.num_code_groups = NUM_CODE_GROUPS

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._space.embed_codec(input_ids.long())


class Qwen3OmniSimModel:
    """What ``Qwen3OmniMoeForConditionalGeneration.talker_preprocess`` and the methods it reaches touch, from
    the sim's rows; an arm's class (the release's methods, the fix, a plugin) is mixed in before it."""

    @classmethod
    def omni_stress_probe(cls) -> Qwen3OmniSimModel:
        """An instance for ``build_mixin`` to read its attributes from."""
        return cls(BF16RowSpace(0))

    def __init__(self, space: RowSpace, async_chunk: bool = False, model_runner: str = "v1") -> None:
        self.talker = _TalkerModule(space)
        tc = SimpleNamespace(codec_nothink_id=CODEC_NOTHINK, codec_think_bos_id=CODEC_THINK_BOS,
                             codec_think_eos_id=CODEC_THINK_EOS, codec_pad_id=CODEC_PAD, codec_bos_id=CODEC_BOS,
                             codec_eos_token_id=CODEC_EOS, text_config=SimpleNamespace(hidden_size=DIM),
                             speaker_id=dict(SPEAKERS))
        self.talker_config = tc
        self.config = SimpleNamespace(im_start_token_id=IM_START, system_token_id=SYSTEM, user_token_id=USER,
                                      assistant_token_id=ASSISTANT, tts_pad_token_id=TTS_PAD_TOKEN, talker_config=tc)
        self.thinker_config = SimpleNamespace(audio_token_id=AUDIO_TOKEN, image_token_id=IMAGE_TOKEN,
                                              video_token_id=VIDEO_TOKEN)
        # what the release's _init_special_tokens_embeddings sets from talker_config.speaker_id
        self.tts_text_spk_token_ids = dict(SPEAKERS)
        self.default_tts_text_spk_type = DEFAULT_SPEAKER
        self.vllm_config = SimpleNamespace(model_config=SimpleNamespace(
            async_chunk=async_chunk, use_v2_model_runner=model_runner == "v2"))

    @staticmethod
    def _module_device(module: Any) -> torch.device:
        return torch.device("cpu")

    def profile_run(self, num_tokens: int) -> None:
        """Qwen3-Omni's Talker keeps no model-level pool for the profile run to size."""


def bind_arm(impl: Any, space: RowSpace, async_chunk: bool, model_runner: str) -> Any:
    """A fresh stand-in with the arm's class mixed in first (``impl`` from ``harness.families.qwen3_omni.arms``)."""
    if isinstance(impl, type):
        cls = type(f"Sim{impl.__name__}", (impl, Qwen3OmniSimModel), {})
        model = cls.__new__(cls)
        Qwen3OmniSimModel.__init__(model, space, async_chunk, model_runner)
        return model
    model = Qwen3OmniSimModel(space, async_chunk, model_runner)
    model.talker_preprocess = types.MethodType(impl, model)  # type: ignore[attr-defined]
    return model


class OmniRunner(SimRunner):
    """vLLM-Omni 0.30.0's runner around Qwen3-Omni's ``talker_preprocess`` (gpu_model_runner.py l.1760-1925),
    with the Thinker's chunks delivered as the connector does (the module docstring)."""

    text_step_added = True  # the talker_mtp path: a decode position runs with its codec row + text_step

    def __init__(self, model: Any, space: RowSpace, cell: tuple[str, str, int], contract: Any,
                 kind: str = "v1") -> None:
        super().__init__(model, space, cell, contract, kind)
        self._step = 0
        self._called: set[str] = set()  # requests whose first call (chunk 0, the payload) is done
        self._next_chunk: dict[str, int] = {}
        self._last_call: dict[str, int] = {}  # the step of each request's latest call

    def add_request(self, out: Any, payload: dict[str, Any], capacity: int) -> None:
        super().add_request(out, payload, capacity)
        self._next_chunk[out.request_id] = 1

    def call(self, request: Any, c: int, n: int, step: int, drafts: list[int] | None = None) -> Any:
        self._step = step
        return super().call(request, c, n, step, drafts)

    def invoke(self, span_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_infos: dict[str, Any],
               is_prefill: bool, n: int) -> Any:
        rid = req_infos["request_id"]
        out = self.thinker[rid]
        if out.async_chunk and rid in self._called:  # one queued chunk merged before each call after the first
            j = self._next_chunk[rid]
            if j < out.T and out.chunk_step(j) <= self._step:
                self._update_buffer(rid, out.chunk(j))
                self._next_chunk[rid] = j + 1
        self._called.add(rid)
        self._last_call[rid] = self._step
        return super().invoke(span_ids, inputs_embeds, req_infos, is_prefill, n)

    def held(self, rid: str, step: int, lag: int) -> bool:
        """Whether the scheduler holds ``rid`` at ``step`` waiting for its next chunk (``harness.sim.chunkhold``;
        the coordinator's ``_request_can_run``): a streamed request after its first call, whose stream is not
        finished (its final chunk not arrived while it is the next to merge), unless its next chunk has arrived
        and ``lag`` steps have passed since its last call (the connector loads a request's next chunk only after
        the call consumed the last; ``sim.chunk_ready_lag``). With ``lag`` 1 and the Thinker ahead (every shipped
        GPU-scale deploy) it holds nothing."""
        out = self.thinker.get(rid)
        if out is None or not out.async_chunk or rid not in self._called:
            return False
        j = self._next_chunk[rid]
        if j >= out.T or (j == out.T - 1 and out.chunk_step(j) <= step):
            return False  # every chunk merged, or the final one (its finish sentinel) received: it runs freely
        return not (out.chunk_step(j) <= step and step - self._last_call[rid] >= lag)

    def invoke_span(self, span_ids: torch.Tensor, inputs_embeds: torch.Tensor, req_infos: dict[str, Any],
                    is_prefill: bool, n: int) -> Any:
        hook = self.model.talker_preprocess
        if n == 1 and not is_prefill:  # the talker_mtp path, as Qwen3-TTS's runner takes it without the batched hook
            return armcall.call(_decode_scalar, hook=hook, span_ids=span_ids, inputs_embeds=inputs_embeds,
                                req_infos=req_infos, sink=self._past)
        return armcall.call(_drop_mtp, hook=hook, span_ids=span_ids, inputs_embeds=inputs_embeds, req_infos=req_infos)


def _drop_mtp(hook: Any, span_ids: torch.Tensor, inputs_embeds: torch.Tensor,
              req_infos: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Any other span: the runner pops ``mtp_inputs`` from the update too (l.1899-1905) and runs the span
    without a text step."""
    ids, rows, update = hook(input_ids=span_ids, input_embeds=inputs_embeds, **req_infos)
    if isinstance(update, dict):
        update.pop("mtp_inputs", None)
    return ids, rows, update


class OmniContract(TTSContract):
    """``harness.families.qwen3_omni.contract`` as array arithmetic over row identities: after the prompt the
    layout is Qwen3-TTS's (``r_{k+1}``, ``tts_eos``, ``tts_pad`` on the position's own codec id), so
    ``TTSContract``'s arithmetic applies to ``OmniRequest``'s fields; only the speaker ids differ."""

    def new_kv(self, out: OmniRequest, capacity: int) -> TalkerKV:
        if self.kv_class is TTSKV:
            return TTSKV(out.request_id, out.P, SPEAKERS[out.speaker], out.output_first_id, capacity,
                         pad_id=self.pad_id, bos_id=self.bos_id)
        return self.kv_class(out.request_id, out.P, SPEAKERS[out.speaker], out.output_first_id, capacity)


def check_deploy(deploy: Deploy) -> None:
    """Refuse what the sim does not model for this family, naming the field."""
    if deploy.async_chunk and deploy.talker.model_runner == "v2":
        raise ConfigError(f"{deploy.path}: talker.model_runner v2 with async_chunk: true: how MRV2 rebuilds a "
                          "resumed request's streamed rows is not modelled by the qwen3-omni sim (use v1, or "
                          "async_chunk: false)")
    if deploy.speculative is not None:
        raise ConfigError(f"{deploy.path}: speculative: the qwen3-omni sim has no speculative decoding model")


def build_cell(impl: Any, deploy: Deploy, prompts: PromptSet, seed: int, talker_mode: str) -> SimCell:
    """``talker_mode``: ``words`` (the words Talker with the Qwen3 start rows) or ``speaking`` (the speaking tiny
    Qwen3-Omni's rules, ``harness.families.qwen3_omni.speaking``, and its tokenizer: one row per byte)."""
    if talker_mode not in ("words", "speaking"):
        raise UserError(f"--sim-talker {talker_mode!r}: unknown sim Talker for qwen3-omni (choose words or speaking)")
    check_deploy(deploy)
    space = BF16RowSpace(seed)
    specials = Specials.make(space)
    if talker_mode == "speaking":
        return _speaking_cell(impl, deploy, prompts, space, specials)
    requests = run_thinker(prompts, space, specials, deploy)
    model = bind_arm(impl, space, deploy.async_chunk, deploy.talker.model_runner)
    frames = deploy.sim.frames_per_text_token
    vocab = CodecVocab.build(m.word for m in space.meanings if m.word is not None)
    sampling = SamplingSettings(**{**deploy.sampling.__dict__, "seed": seed})
    talker = SimTalker(space, vocab, sampling, frames)
    talker.freeze()

    def speak(codes: list[int]) -> tuple[list[int], str, list[str]]:
        units = collapse(codes, vocab, frames)
        return codes, oracle_transcript(units), units

    return SimCell(requests=requests, token_ids={}, space=space, model=model, talker=talker,
                   contract=OmniContract(specials), stop_token_ids=[CODEC_EOS], speak=speak, runner_class=OmniRunner)


def _speaking_cell(impl: Any, deploy: Deploy, prompts: PromptSet, space: RowSpace, specials: Specials) -> SimCell:
    """The ``speaking`` Talker's cell: the Thinker's rows made from the tiny tokenizer's bytes (so ``P`` is the real
    server's), the Talker following ``speaking.next_code`` over the rows each KV position holds now (a replay's
    rewrite included, ``SpeakingKV``), the codec stream read back by ``speaking.decode`` (the real backend's oracle)."""
    from harness.families.qwen3_omni import speaking
    from harness.sim.speaking_talker import SpeakingKV, speaking_parts

    requests = run_thinker(prompts, space, specials, deploy, byte_tokens, newline="\n")
    model = bind_arm(impl, space, deploy.async_chunk, deploy.talker.model_runner)
    frames = deploy.sim.frames_per_text_token
    talker, speak = speaking_parts(space, speaking, frames, byte_kinds=("prompt", "output"))

    return SimCell(requests=requests, token_ids={}, space=space, model=model, talker=talker,
                   contract=OmniContract(specials, SpeakingKV), stop_token_ids=[speaking.CODEC_EOS], speak=speak,
                   runner_class=OmniRunner)


def check_prompts(prompts: PromptSet, talker_mode: str) -> None:
    """``words``: each reply as the words Talker says it must score WER 0 (``harness.sim.talker.check_words``).
    ``speaking``: every question and reply must be one the tiny tokenizer turns into one token per byte."""
    if talker_mode == "speaking":
        from harness.families.qwen3_omni.speaking import check_text

        if prompts.system_prompt:  # the Thinker reads it too, byte by byte
            try:
                check_text(prompts.system_prompt)
            except ValueError as exc:
                raise ConfigError(f"{prompts.path}: system_prompt: {exc} (--sim-talker speaking)") from None
        for i, prompt in enumerate(prompts.prompts):
            for key, text in (("user", prompt.user), ("reply", prompt.reply)):
                try:
                    check_text(text)
                except ValueError as exc:
                    raise ConfigError(f"{prompts.path}: prompts[{i}].{key}: {exc} (prompt {prompt.id!r}; "
                                      "--sim-talker speaking)") from None
        return
    if talker_mode != "words":
        raise ConfigError(f"--sim-talker {talker_mode}: unknown sim Talker for qwen3-omni (choose words or speaking)")
    from harness.sim.talker import check_words

    check_words(prompts)
