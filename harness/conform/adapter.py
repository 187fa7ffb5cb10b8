"""What ``omni-stress conform`` needs from one stage model: the adapter interface.

An adapter is small on purpose. It names the upstream file, class and hook methods
(``harness.talkers.upstream`` extracts and compiles them from any ``vllm-omni:SOURCE``), builds a
CPU stand-in that holds what those methods touch, builds each request's Thinker->stage payload
(with the model's real stage input processor where it has one), and says how vLLM-Omni's runner
calls the hook (``talker_preprocess`` or ``preprocess``; a batched decode hook; the MTP path
that adds a per-step text row to one-token decode positions). The schedule driver
(``harness.conform.driver``) and the comparison (``harness.conform.compare``) are model-agnostic.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from harness.errors import ConfigError
from harness.talkers.release import RELEASE_SHIMS, read_model_source  # noqa: F401 - this module's API too

VENDOR_DIR = Path(__file__).parent / "vendor" / "vllm-omni-0.30.0"
VENDORED_VERSION = "0.30.0"
UNRESOLVED: Any = object()  # ``Adapter.preprocess``'s decode hook not resolved by the caller


@dataclass
class ConformRequest:
    """One request: the ids the scheduler sees, the payload the stage starts with, and the
    codec tokens it "generates" (fixed in advance, so every schedule feeds the same ids)."""

    request_id: str
    prompt_ids: list[int]  # the stage's prompt token ids (length P), as the scheduler sees them
    payload: dict[str, Any]  # the intermediate buffer the runner starts the request with
    generated: list[int]  # teacher-forced output tokens: position P + k holds generated[k]

    @property
    def P(self) -> int:  # noqa: N802 -- the contract's name
        return len(self.prompt_ids)

    @property
    def tokens(self) -> list[int]:
        """Token at each position: the prompt, then the generated tokens."""
        return self.prompt_ids + self.generated


@dataclass
class PreprocessResult:
    ids: Any
    rows: torch.Tensor  # what the hook returned for the span (the runner copies rows[:min(n, len)])
    update: Any  # merged into the request's buffer
    text_step: torch.Tensor | None = None  # MTP decode: the text row the runner adds to the position


@dataclass
class Provenance:
    """Where the code under test came from (shown in every report)."""

    model: str
    what: str  # e.g. "vllm-omni 0.30.0 qwen3_omni.py (sha256 d50550b0…)" or "built-in arm harness.families.qwen2_5_omni.pr"
    files: list[dict[str, Any]] = field(default_factory=list)  # location, version, sha256, methods, stubbed


def tagged(count: int, dim: int, *tag: object) -> torch.Tensor:
    """``count`` distinct deterministic float32 rows for one (request, source)."""
    seed = int.from_bytes(hashlib.sha256(repr(tag).encode()).digest()[:8], "little") & ((1 << 63) - 1)
    return torch.randn(count, dim, generator=torch.Generator().manual_seed(seed))


def fixed_tokens(request_id: str, count: int, vocab: int) -> list[int]:
    """The teacher-forced codec tokens of a request: deterministic, below ``vocab``."""
    gen = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "little")
                                        & ((1 << 63) - 1))
    return torch.randint(0, vocab, (count,), generator=gen).tolist()


class Adapter:
    """One model (or one built-in arm) under the conformance check."""

    name: str = ""
    title: str = ""
    upstream: bool = True  # reads real upstream code from --source (False: a built-in arm)
    member: str = ""  # the model file inside a vLLM-Omni tree
    class_name: str = ""
    entries: tuple[str, ...] = ("talker_preprocess",)
    module_name: str = ""
    has_mtp: bool = False  # the runner's talker_mtp path: decode n == 1 adds update["mtp_inputs"][1]
    codec_vocab: int = 2048  # teacher-forced tokens are drawn below this
    hidden: int = 64
    notes: str = ""  # what the stand-in supplies; shown in docs/conform.md and --json
    deploys: Any = None  # harness.conform.reach.ModelDeploys: the release's deploy files for this model
    # model runners to check, each its own matrix row; None: those the release's deploys of this model use
    # (harness.conform.check.runners_for: v1, and v2 where a deploy runs the stage on MRV2)
    runners: tuple[str, ...] | None = None
    plugin: str | None = None  # "package.module:attr": a plugin arm over the release's code (--model NAME:module:attr)
    # V1 hands a model that is not SupportsMultiModal the runner's persistent inputs_embeds rows, never filled
    # with the span's embeddings (gpu_model_runner.py l.1684-1687: only multimodal models get embed_input_ids
    # first): a row the hook does not fill keeps what an earlier step left there (Qwen3-TTS, MiniCPM-o)
    stale_rows: bool = False
    # async_chunk changes this model's path (Qwen3-Omni: decode text from the streamed cached_decode rows):
    # each chunking mode its deploys use gets its own row, and ``async_chunk`` says which one this instance checks
    chunk_modes: bool = False
    async_chunk: bool = False
    # (runner, async_chunk) modes no row checks: their deploys count as not modelled, with this reason
    unmodelled_modes: dict[tuple[str, bool | None], str] = {}
    # modes checked although no shipped deploy uses them (Qwen3-Omni's async_chunk: false full-payload path)
    extra_modes: tuple[tuple[str, bool | None], ...] = ()
    # the model's family's own deploys, run in place of the shipped deploy of the same role (the columns
    # "vllm:reference" / "vllm:stress" are Qwen2.5-Omni's deploys): {(runner, deploy name): its own deploy}
    own_deploys: dict[tuple[str, str], str] = {}

    def own_deploy(self, deploy: Any, runner: str) -> Any:
        """The deploy ``deploy``'s column runs for this model under ``runner``: the family's own, else itself."""
        from harness.config import load_deploy

        name = self.own_deploys.get((runner, deploy.name))
        return deploy if name is None else load_deploy(name)

    # ------------------------------------------------------------------ loading
    def load(self, spec: str, base_dir: Path | None = None, wheel_dir: Path | None = None) -> tuple[Any, Provenance]:
        """The implementation (a class to mix into the stand-in) and where it came from."""
        from harness.sim.hooks import RUNNER_HOOKS
        from harness.talkers.upstream import build_mixin

        source = read_model_source(spec, self.member, base_dir, wheel_dir)
        mixin = build_mixin(source, self.stand_in_class(), class_name=self.class_name, entries=self.entries,
                            module_name=self.module_name, shims=self.all_shims(), optional=RUNNER_HOOKS)
        info = mixin.omni_stress_upstream
        prov = Provenance(self.name, f"vLLM-Omni {source.version or '?'} {Path(self.member).name} "
                                     f"(sha256 {source.sha256[:12]})",
                          [_file_info(source, info.methods, info.stubbed, info.from_stand_in)])
        self.extra_sources(spec, base_dir, wheel_dir, prov)
        return mixin, prov

    def load_checked(self, spec: str, base_dir: Path | None = None,
                     wheel_dir: Path | None = None) -> tuple[Any, Provenance | None]:
        """``load``, then a plugin arm's class over it: the plugin's methods replace the release's methods of
        the same name (the hook, say); everything else (helpers, the stand-in) stays."""
        impl, prov = self.load(spec, base_dir, wheel_dir)
        if not self.plugin:
            return impl, prov
        cls = load_plugin(self.plugin, self.name, self.entries[0])
        mixed = type(f"Plugin{cls.__name__}", (cls, impl), {})
        what = f"plugin arm {self.plugin} over " + (prov.what if prov else "the release's code")
        return mixed, Provenance(self.name, what, prov.files if prov else [])

    def extra_sources(self, spec: str, base_dir: Path | None, wheel_dir: Path | None, prov: Provenance) -> None:
        """Load more upstream code (a stage input processor); record it in ``prov``."""

    def shims(self) -> dict[tuple[str, str], Any]:
        """``(module, name) -> object`` for names the hooks import; every adapter gets ``RELEASE_SHIMS``."""
        return {}

    def all_shims(self) -> dict[tuple[str, str], Any]:
        return {**RELEASE_SHIMS, **self.shims()}

    def stand_in_class(self) -> type:
        raise NotImplementedError

    # ------------------------------------------------------------------ per run
    def make_model(self, impl: Any) -> Any:
        """A fresh stand-in with the implementation bound (fresh model-level state)."""
        cls = type(f"Conform{impl.__name__}", (impl, self.stand_in_class()), {})
        return cls()

    def requests(self, count: int, generated: int) -> list[ConformRequest]:
        raise NotImplementedError

    def embed(self, model: Any, ids: torch.Tensor) -> torch.Tensor:
        """The runner's starting rows for a span: the stage's embedding of the span's ids."""
        return model.talker.embed_input_ids(ids).float()

    def preprocess(self, model: Any, ids: torch.Tensor, embeds: torch.Tensor, info: dict[str, Any],
                   is_prefill: bool, runner: str = "v1", decode_hook: Any = UNRESOLVED) -> PreprocessResult:
        """One call as vLLM-Omni 0.30.0's runner makes it (V1: gpu_model_runner.py l.1760-1920; MRV2:
        omni_model_state.py): a one-token decode goes to the decode hook ``runner`` resolves where the model
        defines one (``harness.sim.hooks``), every other span to the model's per-span hook. ``decode_hook``:
        that hook as the caller resolved it once (``ConformRunner``), else resolved here."""
        from harness.sim import hooks

        n = int(ids.shape[0])
        decode = None
        if n == 1 and not is_prefill:
            decode = hooks.decode_hook(model, runner) if decode_hook is UNRESOLVED else decode_hook
        if decode is not None:
            out_ids, rows, _past, text_step, updates = hooks.unpack_decode(
                decode(input_ids=ids, input_embeds=embeds, req_infos=[info]))
            if len(updates) != 1:
                raise ValueError(f"the batched decode hook returned {len(updates)} updates for 1 request")
            step = text_step[0:1] if self.has_mtp and text_step is not None else None
            return PreprocessResult(out_ids, rows, updates[0], step)
        out_ids, rows, update = getattr(model, self.entries[0])(input_ids=ids, input_embeds=embeds, **info)
        text_step = None
        if self.has_mtp and n == 1 and not is_prefill and isinstance(update, dict) and "mtp_inputs" in update:
            _past, text_step = update.pop("mtp_inputs")
        return PreprocessResult(out_ids, rows, update, text_step)

    def deliver(self, req: ConformRequest, state: dict[str, Any], calls: int, c: int = 0) -> dict[str, Any] | None:
        """What is merged into the request's buffer before its call number ``calls`` (0 is the first call), a
        span starting at ``c``: a streamed chunk, or what the model's own sampling stored after the previous
        step (teacher-forced like the ids); ``state`` is this run's per-request delivery state. None: nothing
        (the default: the payload arrives whole before the first call)."""
        return None

    def generated_count(self, model: Any, request_id: str) -> int | None:
        """The model's own count of the frames it has generated for the request, read after each call (Gepard's
        ``frame_count``): the restart check compares it with the frames the schedule generated. None: the model
        keeps no such counter (the default)."""
        return None

    def named_rows(self, model: Any) -> dict[str, torch.Tensor]:
        """Rows worth naming when a position receives one of them (special text rows)."""
        return {}

    def request_tables(self, req: ConformRequest) -> dict[str, torch.Tensor]:
        """A request's payload rows worth naming (``label -> [K, hidden]``; row ``k`` is "label k")."""
        return {}


def _file_info(source: Any, methods: tuple[str, ...], stubbed: tuple[str, ...],
               from_stand_in: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"location": source.location, "version": source.version, "sha256": source.sha256,
            "methods": list(methods), "stubbed": list(stubbed), "from_stand_in": list(from_stand_in)}


def load_plugin(target: str, model: str, hook: str) -> type:
    """A plugin arm ``package.module:attr``: a class that defines ``hook`` (or a function, taken as ``hook``),
    imported as ``omni-stress run --arm NAME=package.module:attr`` imports one (the working directory is
    importable)."""
    from harness.talkers import import_target

    module_name, _, attr = target.partition(":")
    where = f"--model {model}"
    if not module_name or not attr:
        raise ConfigError(f"{where}: expected MODEL:package.module:attr")
    obj = import_target(target, where)
    if isinstance(obj, type):
        if not callable(getattr(obj, hook, None)):
            raise ConfigError(f"{where}: class {attr!r} defines no {hook} method (the hook this model's runner calls)")
        return obj
    if callable(obj):
        return type(f"{attr}Arm", (), {hook: obj})
    raise ConfigError(f"{where}: {attr!r} is neither a class nor a function")

