"""Load deploys, arms and prompt sets from YAML into validated dataclasses.

Every error names the file and the field (``deploy_configs/stress.yaml: talker.max_num_seqs:
must be a positive integer, got 0``) so the CLI can print one line and exit 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness.errors import ConfigError, short_repr
from harness.family import DEFAULT_FAMILY, family_names, get_family
from harness.roles import DEPLOY_ROLES, deploy_role
from harness.physics import FRAMES_PER_TEXT_TOKEN

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEPLOY_DIR = PROJECT_ROOT / "deploy_configs"
PROMPT_DIR = PROJECT_ROOT / "prompts"

# Seed settings (DESIGN.md "prompt set"): Thinker greedy <= 80 tokens; Talker sampling.
MAX_REPLY_TOKENS = 80

# Upper bounds of deploy numbers (docs/robustness.md): a value past them is a typo, and would
# otherwise fail deep inside a run (the sim's profile run allocates 256 bytes per batched token,
# so 10**12 tokens asked the allocator for 256 TB) after the run directory exists.
MAX_MODEL_LEN = 32768  # the Talker's max_position_embeddings
MAX_BATCHED_TOKENS = 262_144  # 8x vLLM-Omni's Talker default of 32768; 64 MB in the sim's profile run
MAX_NUM_SEQS = 1024  # vLLM's largest default max_num_seqs
MAX_KV_BLOCKS = 262_144  # vLLM builds one Python object per block: ~1 s and ~100 MB at this size
MAX_SEED = 2**32 - 1  # the same range as `run --seed`
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)  # vLLM's CacheConfig.BlockSize (vllm/config/cache.py)
_INT_LIMITS = {  # field name -> largest value accepted (the smallest is 1, seed 0)
    "max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
    "num_gpu_blocks_override": MAX_KV_BLOCKS, "max_model_len": MAX_MODEL_LEN, "block_size": max(BLOCK_SIZES),
    "top_k": 1_000_000, "seed": MAX_SEED, "max_tokens": MAX_MODEL_LEN,
    "frames_per_text_token": 1000, "default_max_num_batched_tokens": MAX_BATCHED_TOKENS,
    "default_max_model_len": MAX_MODEL_LEN, "max_steps": 10_000_000, "num_speculative_tokens": 64,
    "chunk_ready_lag": 64,
}

_CHOICES = {"model_runner": ("v1", "v2")}  # string settings: the values accepted

_LIMIT_WHY = {  # said next to the limit, so the user knows what it protects
    "max_num_batched_tokens": "8x vLLM-Omni's Talker default; the sim's profile run allocates 256 bytes per token",
    "max_model_len": "the Talker's max_position_embeddings", "max_tokens": "the Talker's max_position_embeddings",
    "num_gpu_blocks_override": "vLLM builds one Python object per KV block",
    "max_num_seqs": "vLLM's largest default", "seed": "a 32-bit seed, as `run --seed`",
}

# Prompt ids, arm, deploy and run names become file and folder names (audio/<arm>-<deploy>-r1-<id>.wav,
# results/<run-id>/): one path component of portable characters, so nothing is written outside the run.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
SAFE_NAME_RULE = "1-100 letters, digits, '.', '_' or '-', starting with a letter or digit"


def check_name(value: str) -> str | None:
    """None when ``value`` is a safe file-name component, else what is wrong with it."""
    if SAFE_NAME.fullmatch(value):
        return None
    return f"{short_repr(value)} is not a safe name ({SAFE_NAME_RULE}; it names files in the run directory)"


# --------------------------------------------------------------------------- helpers


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the
    last value silently, so ``max_num_seqs: 4`` then ``max_num_seqs: 1`` would run with 1)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:  # type: ignore[override]
        seen: dict[Any, int] = {}
        for key_node, _value in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<' merges are overridden by explicit keys on purpose
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the base class reports it
                continue
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    def __init__(self, key: Any, first: int, again: int) -> None:
        super().__init__(key, first, again)
        self.key, self.first, self.again = key, first, again


def load_yaml(path: Path) -> Any:
    """The YAML document in ``path``; every way it can be unreadable is one ConfigError naming it."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a folder, not a YAML file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                          "save the file as UTF-8") from None
    if (bad := _NON_PRINTABLE.search(text)) is not None:
        raise ConfigError(f"{path}: {_where(text, bad.start())}: {_char_name(bad.group())} is not allowed in YAML "
                          "(control characters cannot appear in a config file, even quoted); remove it") from None
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    except _DuplicateKey as exc:
        raise ConfigError(f"{path}: line {exc.again}: duplicate key {short_repr(exc.key)} (first given on line {exc.first})") \
            from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{where}: malformed YAML: {' '.join(str(problem).split())}") from None
    except (RecursionError, MemoryError):
        raise ConfigError(f"{path}: malformed YAML: nested too deeply to read "
                          "(a config file needs a few levels)") from None
    finally:
        loader.dispose()


# What PyYAML's reader refuses (yaml.reader.Reader.NON_PRINTABLE): checked first, so the error names the
# line, column and character instead of a ReaderError traceback with an offset into the text.
_NON_PRINTABLE = re.compile("[^\x09\x0A\x0D\x20-\x7E\x85\xA0-\uD7FF\uE000-\uFFFD\U00010000-\U0010ffff]")
_CONTROL_NAMES = {0x00: "NUL", 0x08: "backspace", 0x0B: "vertical tab", 0x0C: "form feed",
                  0x1B: "ESC, the start of a terminal escape sequence", 0x7F: "DEL"}


def _where(text: str, offset: int) -> str:
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    return f"line {line} column {column}"


def _char_name(ch: str) -> str:
    """``control character U+001B (ESC, ...)``: never the character itself (it could drive the terminal)."""
    name = _CONTROL_NAMES.get(ord(ch)) or unicodedata.name(ch, "").lower() or "a control character"
    kind = "control character" if unicodedata.category(ch).startswith("C") else "character"
    return f"{kind} U+{ord(ch):04X} ({name})"


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


class _Fields:
    """Reads typed fields out of one mapping, naming file and dotted field on error."""

    def __init__(self, source: Path, data: Any, prefix: str = "") -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: {prefix or 'top level'}: expected a mapping, got {type(data).__name__}")
        self.source, self.data, self.prefix = source, data, prefix

    def name(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def fail(self, key: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {self.name(key)}: {msg}")

    def reject_unknown(self, allowed: set[str]) -> None:
        for key in self.data:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                raise self.fail(short_repr(key) if not isinstance(key, str) or len(key) > 200 else key,
                                f"unknown key (allowed: {hint})")

    def sub(self, key: str) -> _Fields:
        return _Fields(self.source, self.data.get(key), f"{self.name(key)}.")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def str_(self, key: str, default: str | None = None, required: bool = False) -> str | None:
        value = self.data.get(key, default)
        if value is None:
            if required:
                raise self.fail(key, "missing required field")
            return None
        if not isinstance(value, str) or (required and not value.strip()):
            raise self.fail(key, f"must be a non-empty string, got {short_repr(value)}")
        return value

    def int_(self, key: str, default: int | None = None, minimum: int = 1, maximum: int | None = None,
             why: str | None = None) -> int | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise self.fail(key, f"must be {kind}, got {short_repr(value)}")
        if maximum is not None and value > maximum:
            raise self.fail(key, f"must be at most {maximum}{f' ({why})' if why else ''}, got {short_repr(value)}")
        return value

    def float_(self, key: str, default: float | None, lo: float, hi: float) -> float | None:
        value = self.data.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise self.fail(key, f"must be a number in [{lo}, {hi}], got {short_repr(value)}")
        return float(value)

    def bool_(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, got {short_repr(value)}")
        return value


# --------------------------------------------------------------------------- deploys


@dataclass(frozen=True)
class SamplingSettings:
    """Talker sampling of the seed: temperature 0.9, top-p 0.8, top-k 40, seed 42, max 1900."""

    temperature: float = 0.9
    top_p: float = 0.8
    top_k: int = 40
    seed: int = 42
    max_tokens: int = 1900


@dataclass(frozen=True)
class TalkerSettings:
    """Talker stage (stage 1) engine settings; ``None`` means vLLM's default."""

    max_num_seqs: int = 4
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool | None = None
    num_gpu_blocks_override: int | None = None
    block_size: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = False  # vLLM-Omni's qwen2_5_omni deploy sets false on every stage
    gpu_memory_utilization: float | None = None
    # vLLM-Omni's model runner for this stage (a deploy's ``model_runner:``): ``v1`` (gpu_model_runner.py, every
    # platform) or ``v2`` (MRV2, worker_v2/omni_model_runner.py, CUDA only). They differ on a preemption: V1 keeps
    # the request's intermediate buffer, MRV2 drops it and the resumed request starts from its payload again.
    model_runner: str = "v1"


@dataclass(frozen=True)
class StageSettings:
    max_num_seqs: int = 1


@dataclass(frozen=True)
class SpecDecodeSettings:
    num_speculative_tokens: int = 2
    acceptance_rate: float = 0.5


@dataclass(frozen=True)
class SimSettings:
    """Knobs of the CPU simulation only (ignored by the real backend)."""

    frames_per_text_token: int = FRAMES_PER_TEXT_TOKEN  # R = 19: derived in harness/physics.py
    thinker_steps_per_token: float = 1.0  # Talker steps the Thinker needs per reply token
    # a streamed request (``async_chunk: true`` with a Thinker): the fewest Talker steps from one of its calls to
    # the next while Thinker chunks are still to come (the connector loads its next chunk only after the call
    # consumed the last, and the scheduler hears of it from a step's output): 1, the chunk loads within the step;
    # 2, after it (measured on the CPU server). docs/families/qwen3_omni.md, "Waiting for chunks"
    chunk_ready_lag: int = 1
    default_max_num_batched_tokens: int = 32768  # vLLM-Omni's qwen2_5_omni stage default
    default_max_model_len: int = 32768  # Talker's max_position_embeddings when unset
    max_steps: int = 200_000  # hard bound on the scheduler loop


LOAD_MODES = ("all", "concurrency", "poisson")
MAX_LOAD_RATE = 1000.0  # requests per sim step (or per second on the real backend)
MAX_LOAD_JITTER = 100_000  # steps


@dataclass(frozen=True)
class LoadSettings:
    """How the Talker's requests arrive (DESIGN.md "Stress as a map"). ``all``: every request is
    sent at once (the seed; on the sim each reaches the Talker when its Thinker finishes);
    ``concurrency``: at most ``concurrency`` requests in flight, the next sent when one finishes;
    ``poisson``: sent at seeded exponential gaps of mean ``1 / rate`` (per sim step; per second on
    the real backend). ``jitter``: sim only, each send is delayed by a seeded 0..jitter steps (the
    run's seed draws it, so repeats and seeds explore different schedules)."""

    mode: str = "all"
    concurrency: int | None = None
    rate: float | None = None
    jitter: int = 0

    @property
    def label(self) -> str:
        """``all``, ``c4``, ``p0.05``, with ``+j8`` for a jitter."""
        base = {"all": "all", "concurrency": f"c{self.concurrency}", "poisson": f"p{self.rate:g}"}[self.mode]
        return base + (f"+j{self.jitter}" if self.jitter else "")


DEFAULT_LOAD = LoadSettings()


@dataclass(frozen=True)
class Deploy:
    name: str
    description: str
    path: Path
    talker: TalkerSettings
    thinker: StageSettings
    code2wav: StageSettings
    async_chunk: bool
    sampling: SamplingSettings
    sim: SimSettings
    speculative: SpecDecodeSettings | None = None
    load: LoadSettings = DEFAULT_LOAD
    # A sweep's grid point (harness/sweep/grid.py): the (dotted key, value) pairs applied to ``path``'s
    # YAML. The config hash covers them, so --resume refuses a point whose values changed.
    overrides: tuple[tuple[str, Any], ...] = ()
    # The model family whose stage this deploy configures (harness.families); a deploy without a
    # ``family:`` key is Qwen2.5-Omni's, so the shipped deploys' files and hashes are unchanged.
    family: str = DEFAULT_FAMILY
    # What the deploy is for (DEPLOY_ROLES): a ``reference`` deploy is what a ``stress`` deploy is
    # measured against, and ``pair`` names that reference (the paired table, its audio players and the
    # gate's ``reference_deploy: pair`` use it, for every family); see ``deploy_role``.
    role: str = "stress"
    pair: str | None = None
    slo: StreamingSlo | None = None  # goodput's SLO for this deploy's streamed requests (``slo:``)

    @property
    def config_hash(self) -> str:
        if not self.overrides:
            return file_hash(self.path)
        import json

        digest = hashlib.sha256(self.path.read_bytes())
        digest.update(json.dumps([list(o) for o in self.overrides], sort_keys=True).encode())
        return digest.hexdigest()[:16]


_DEPLOY_KEYS = {"name", "description", "talker", "thinker", "code2wav", "async_chunk", "sampling", "sim", "speculative",
                "load", "family", "role", "pair", "slo"}


def _family_field(f: _Fields) -> str:
    """A ``family:`` key (deploy, prompt set or arm): one of the registered families' names."""
    family = f.str_("family", default=DEFAULT_FAMILY) or DEFAULT_FAMILY
    if family not in family_names():
        raise f.fail("family", f"unknown model family {short_repr(family)} (known: {', '.join(family_names())})")
    return family


@dataclass(frozen=True)
class StreamingSlo:
    """What a streamed request must meet to count toward goodput (``harness.streaming_figures``): its first
    audio packet within ``ttfp_s`` seconds and no stall over ``max_stall_s`` (None: not bounded). A deploy
    gives it as ``slo:``; ``report``/``gate --slo`` override it."""

    ttfp_s: float | None = None
    max_stall_s: float | None = 0.1

    def describe(self) -> str:
        parts = ([f"TTFP <= {self.ttfp_s:g} s"] if self.ttfp_s is not None else []) + (
            [f"no stall over {self.max_stall_s * 1000:g} ms"] if self.max_stall_s is not None else [])
        return " and ".join(parts) or "none (every answered stream meets it)"


SLO_KEYS = ("ttfp_s", "max_stall_s")
MAX_SLO_S = 3600.0


def parse_slo(data: Any, where: str) -> StreamingSlo:
    """``{ttfp_s: X, max_stall_s: Y}`` (either may be omitted or null: unbounded), checked; ``where`` names
    the file and field (or the option) in the error."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: must be a mapping with {' and/or '.join(SLO_KEYS)}, got {short_repr(data)}")
    unknown = sorted(set(map(str, data)) - set(SLO_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(SLO_KEYS)})")
    values: dict[str, float | None] = {}
    for key in SLO_KEYS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value <= MAX_SLO_S):
            raise ConfigError(f"{where}.{key}: must be seconds in [0, {MAX_SLO_S:g}] or null, got {short_repr(value)}")
        values[key] = None if value is None else float(value)
    return StreamingSlo(ttfp_s=values["ttfp_s"], max_stall_s=values["max_stall_s"])


def slo_option(text: str) -> StreamingSlo:
    """``--slo ttfp_s=X,max_stall_s=Y`` (a key left out is unbounded, ``none`` unbounds it) as an SLO."""
    data: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--slo {text!r}: expected KEY=SECONDS pairs ({', '.join(SLO_KEYS)}), got {part!r}")
        try:
            data[key.strip()] = None if value.strip().lower() in ("none", "null") else float(value)
        except ValueError:
            raise ConfigError(f"--slo {text!r}: {key.strip()}: not a number of seconds: {value!r}") from None
    return parse_slo(data, "--slo")


def _load_settings(top: _Fields) -> LoadSettings:
    if not top.has("load"):
        return DEFAULT_LOAD
    f = top.sub("load")
    f.reject_unknown({"mode", "concurrency", "rate", "jitter"})
    mode = f.data.get("mode", "all")
    if mode not in LOAD_MODES:
        raise f.fail("mode", f"must be one of {', '.join(LOAD_MODES)}, got {short_repr(mode)}")
    concurrency = f.int_("concurrency", None, maximum=MAX_NUM_SEQS, why="vLLM's largest default max_num_seqs")
    rate = f.float_("rate", None, 0.0, MAX_LOAD_RATE)
    jitter = f.int_("jitter", 0, minimum=0, maximum=MAX_LOAD_JITTER) or 0
    if mode == "concurrency" and concurrency is None:
        raise f.fail("concurrency", "missing (load mode concurrency needs the number of requests in flight)")
    if mode == "poisson" and not rate:
        raise f.fail("rate", "missing or 0 (load mode poisson needs a rate > 0: requests per step)")
    if mode != "concurrency" and concurrency is not None:
        raise f.fail("concurrency", f"applies to mode concurrency only (mode is {mode})")
    if mode != "poisson" and rate is not None:
        raise f.fail("rate", f"applies to mode poisson only (mode is {mode})")
    return LoadSettings(mode=mode, concurrency=concurrency, rate=rate, jitter=jitter)


def _dataclass_from(fields: _Fields, cls: type, floats: dict[str, tuple[float, float]] | None = None) -> Any:
    """Fill a frozen settings dataclass from a mapping, validating each field by its default's type."""
    floats = floats or {}
    allowed = {f.name for f in dataclasses.fields(cls)}
    fields.reject_unknown(allowed)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in fields.data:
            continue
        default = f.default
        if f.name in floats:
            lo, hi = floats[f.name]
            kwargs[f.name] = fields.float_(f.name, None, lo, hi)
        elif isinstance(default, bool) or "bool" in str(f.type):
            value = fields.data[f.name]
            if value is not None and not isinstance(value, bool):
                raise fields.fail(f.name, f"must be true or false, got {short_repr(value)}")
            kwargs[f.name] = value
        elif isinstance(default, float):
            kwargs[f.name] = fields.float_(f.name, None, 0.0, 1e9)
        elif f.name in _CHOICES:
            value = fields.data[f.name]
            if value not in _CHOICES[f.name]:
                raise fields.fail(f.name, f"must be one of {', '.join(_CHOICES[f.name])}, got {short_repr(value)}")
            kwargs[f.name] = value
        else:
            minimum = 0 if f.name == "seed" else 1
            kwargs[f.name] = fields.int_(f.name, None, minimum=minimum, maximum=_INT_LIMITS.get(f.name),
                                         why=_LIMIT_WHY.get(f.name))
    return cls(**kwargs)


def _check_kv_cache(path: Path, t: TalkerSettings, sim: SimSettings) -> None:
    """A KV cache that cannot hold one request of ``max_model_len`` tokens never finishes that
    request (vLLM preempts it, recomputes it, runs out again: the sim saw no progress for
    ``sim.max_steps`` steps); vLLM itself refuses such a cache at start-up, so the deploy is
    refused here, before any run directory exists. Block 0 is vLLM's reserved null block."""
    if t.block_size not in BLOCK_SIZES:
        raise ConfigError(f"{path}: talker.block_size: must be one of {', '.join(map(str, BLOCK_SIZES))} "
                          f"(vLLM's block sizes), got {t.block_size}")
    max_len = t.max_model_len or sim.default_max_model_len
    len_field = "talker.max_model_len" if t.max_model_len else "sim.default_max_model_len (talker.max_model_len unset)"
    # vLLM's SchedulerConfig rules (vllm/config/scheduler.py, verify_max_model_len), named by field here
    batched = t.max_num_batched_tokens or sim.default_max_num_batched_tokens
    batched_field = ("talker.max_num_batched_tokens" if t.max_num_batched_tokens else
                     "sim.default_max_num_batched_tokens (talker.max_num_batched_tokens unset)")
    if batched < t.max_num_seqs:
        raise ConfigError(f"{path}: {batched_field}: {batched} is below talker.max_num_seqs {t.max_num_seqs}; "
                          "vLLM requires max_num_batched_tokens >= max_num_seqs")
    if t.enable_chunked_prefill is False and batched < max_len:
        raise ConfigError(f"{path}: {batched_field}: {batched} is below {len_field} {max_len} with "
                          "talker.enable_chunked_prefill false; vLLM requires max_num_batched_tokens >= max_model_len "
                          "without chunked prefill")
    need = math.ceil(max_len / t.block_size)
    if t.num_gpu_blocks_override is not None:
        if t.num_gpu_blocks_override - 1 < need:
            raise ConfigError(
                f"{path}: talker.num_gpu_blocks_override: {t.num_gpu_blocks_override} blocks "
                f"({t.num_gpu_blocks_override - 1} usable, block 0 is reserved) of {t.block_size} tokens are too few "
                f"for one request of {len_field} {max_len} tokens, which needs {need}; give at least {need + 1} "
                f"blocks or lower talker.max_model_len")
    elif t.max_num_seqs * need + 1 > MAX_KV_BLOCKS:
        raise ConfigError(f"{path}: talker: the default KV cache (max_num_seqs {t.max_num_seqs} x {need} blocks of "
                          f"{t.block_size} tokens for {len_field} {max_len}) would have {t.max_num_seqs * need + 1} "
                          f"blocks, over the limit of {MAX_KV_BLOCKS}; set talker.num_gpu_blocks_override, a larger "
                          f"talker.block_size or a smaller talker.max_model_len")


def load_deploy(name_or_path: str) -> Deploy:
    path = _resolve(name_or_path, DEPLOY_DIR, "deploy")
    return parse_deploy(path, load_yaml(path))


def parse_deploy(path: Path, data: Any, overrides: tuple[tuple[str, Any], ...] = ()) -> Deploy:
    """A validated Deploy from a loaded deploy document (``overrides``: a sweep point's, already
    applied to ``data``; they go into the config hash)."""
    top = _Fields(path, data)
    top.reject_unknown(_DEPLOY_KEYS)
    name = top.str_("name", default=path.stem, required=True)
    assert name is not None
    if (bad := check_name(name)) is not None:
        raise top.fail("name", bad)
    talker = _dataclass_from(top.sub("talker"), TalkerSettings, {"gpu_memory_utilization": (0.01, 1.0)})
    if talker.num_gpu_blocks_override is not None and talker.num_gpu_blocks_override < 2:
        raise ConfigError(f"{path}: talker.num_gpu_blocks_override: must be >= 2 (block 0 is reserved)")
    sampling = _dataclass_from(top.sub("sampling"), SamplingSettings, {"temperature": (0.0, 10.0), "top_p": (0.0, 1.0)})
    if sampling.top_p <= 0.0:  # nothing would survive the top-p filter
        raise ConfigError(f"{path}: sampling.top_p: must be above 0 (vLLM takes top_p in (0, 1]), got {sampling.top_p!r}")
    sim = _dataclass_from(top.sub("sim"), SimSettings, {"thinker_steps_per_token": (0.0, 1000.0)})
    _check_kv_cache(path, talker, sim)
    spec = None
    if top.has("speculative"):
        spec = _dataclass_from(top.sub("speculative"), SpecDecodeSettings, {"acceptance_rate": (0.0, 1.0)})
    return Deploy(
        name=name,
        description=top.str_("description", default="") or "",
        path=path,
        talker=talker,
        thinker=_dataclass_from(top.sub("thinker"), StageSettings),
        code2wav=_dataclass_from(top.sub("code2wav"), StageSettings),
        async_chunk=top.bool_("async_chunk", False),
        sampling=sampling,
        sim=sim,
        speculative=spec,
        load=_load_settings(top),
        overrides=overrides,
        family=_family_field(top),
        slo=parse_slo(top.data["slo"], f"{path}: slo") if top.has("slo") else None,
        **_role_fields(top, name),
    )


def _role_fields(top: _Fields, name: str) -> dict[str, Any]:
    """``role`` and ``pair`` of a deploy document, checked (``deploy_role`` fills what is not declared)."""
    role = top.str_("role")
    if role is not None and role not in DEPLOY_ROLES:
        raise top.fail("role", f"must be one of {', '.join(DEPLOY_ROLES)}, got {short_repr(role)}")
    pair = top.str_("pair")
    if pair is not None:
        if (bad := check_name(pair)) is not None:
            raise top.fail("pair", bad)
        if pair == name:
            raise top.fail("pair", f"names the deploy itself ({name}); a stress deploy pairs with a reference deploy")
        if deploy_role(name, role)[0] == "reference":
            raise top.fail("pair", "a reference deploy has no pair (it is what stress deploys pair with)")
    role, pair = deploy_role(name, role, pair)
    return {"role": role, "pair": pair}


# --------------------------------------------------------------------------- arms


@dataclass(frozen=True)
class ServeSettings:
    """How the real backend starts this arm's vLLM-Omni: an interpreter or a command prefix."""

    python: str | None = None
    command: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # True: the server binds this arm's talker_preprocess onto the installed vLLM-Omni's real model
    # (harness.serve.arm_binding); False: the environment's vLLM-Omni runs as it is installed.
    bind_arm: bool = True
    # The vLLM-Omni release the server must run (harness.serve.releases): without python/command, that release's
    # environment (scripts/install-real-cpu.sh); with them, checked against what they have installed.
    release: str | None = None


@dataclass(frozen=True)
class ArmSpec:
    """One implementation under test. ``talker`` is ``module:attr`` (a class or function)."""

    name: str
    talker: str
    description: str = ""
    serve: ServeSettings | None = None
    source: str = "builtin"
    role: str = "candidate"  # ARM_ROLES: which gate rules apply (baseline: expected to show the bug)
    family: str = DEFAULT_FAMILY  # the model family whose hook this arm implements (harness.families)
    # ``module:attr`` called in place of the release's Talker -> Code2Wav window builder on a streaming
    # deploy (``harness.serve.chunk_trace``; a plugin's own chunking, or the tests' corrupting ones)
    chunker: str | None = None


ARM_ROLES = ("baseline", "candidate")


ARMS_FILE = DEPLOY_DIR / "arms.yaml"
RELEASE_VERSION = re.compile(r"^\d+\.\d+\.\d+([a-z]+\d+)?$")  # serve: release: (harness.serve.releases)


def load_arms(path: Path = ARMS_FILE) -> dict[str, ArmSpec]:
    data = load_yaml(path)
    top = _Fields(path, data)
    top.reject_unknown({"arms"})
    arms_f = top.sub("arms")
    arms: dict[str, ArmSpec] = {}
    for name in arms_f.data:
        f = arms_f.sub(str(name))
        if (bad := check_name(str(name))) is not None:
            raise ConfigError(f"{path}: arms.{name}: {bad}")
        f.reject_unknown({"talker", "description", "serve", "role", "family", "chunker"})
        role = f.data.get("role", "candidate")
        if role not in ARM_ROLES:
            raise f.fail("role", f"must be one of {', '.join(ARM_ROLES)}, got {short_repr(role)}")
        talker = f.str_("talker", required=True)
        assert talker is not None
        if ":" not in talker:
            raise f.fail("talker", f"must be 'package.module:attr', got {short_repr(talker)}")
        serve = None
        if f.has("serve"):
            s = f.sub("serve")
            s.reject_unknown({"python", "command", "env", "bind_arm", "release"})
            command = s.data.get("command") or []
            if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
                raise s.fail("command", "must be a list of strings")
            env = s.data.get("env") or {}
            if not isinstance(env, dict):
                raise s.fail("env", "must be a mapping of strings")
            release = s.str_("release")
            if release is not None and not RELEASE_VERSION.match(release):
                raise s.fail("release", f"must be a vLLM-Omni version such as 0.32.0rc1, got {short_repr(release)}")
            if not s.has("python") and not command and release is None:
                raise s.fail("python", "give 'python' (a venv interpreter), 'command' (a prefix) or 'release' (the "
                                       "environment scripts/install-real-cpu.sh builds for it)")
            bind_arm = s.data.get("bind_arm", True)
            if not isinstance(bind_arm, bool):
                raise s.fail("bind_arm", f"must be true or false, got {short_repr(bind_arm)}")
            serve = ServeSettings(python=s.str_("python"), command=tuple(command),
                                  env={str(k): str(v) for k, v in env.items()}, bind_arm=bind_arm,
                                  release=release)
        chunker = f.str_("chunker")
        if chunker is not None and ":" not in chunker:
            raise f.fail("chunker", f"must be 'package.module:attr', got {short_repr(chunker)}")
        arms[str(name)] = ArmSpec(name=str(name), talker=talker, description=f.str_("description") or "",
                                  serve=serve, source=str(path), role=role, family=_family_field(f),
                                  chunker=chunker)
    return arms


# --------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    id: str
    user: str
    reply: str  # the scripted Thinker reply (sim) and the WER reference
    audio_seconds: float = 0.0  # sim: an audio input of this length in the Thinker prompt
    # the voice to say it in (a family with ``Family.speakers``: one of them); None: the family's default
    speaker: str | None = None
    # a Base voice instead (a family with ``Family.speaker_embeddings``): the x-vector the release's Base
    # checkpoint puts in the speaker's row (the API's ``speaker_embedding``); None: a CustomVoice prompt
    speaker_embedding: tuple[float, ...] | None = None

    def thinker_prompt(self, system_prompt: str) -> str:
        from harness.tokenizer import chat_prompt

        return chat_prompt(system_prompt, self.user, self.audio_seconds)


@dataclass(frozen=True)
class PromptSet:
    name: str
    description: str
    system_prompt: str
    prompts: tuple[Prompt, ...]
    path: Path
    family: str = DEFAULT_FAMILY  # the model family these prompts are written for (harness.families)

    @property
    def config_hash(self) -> str:
        return file_hash(self.path)


def load_prompts(name_or_path: str) -> PromptSet:
    from harness.tokenizer import tokenize  # local: keeps config import-light

    path = _resolve(name_or_path, PROMPT_DIR, "prompt set")
    top = _Fields(path, load_yaml(path))
    top.reject_unknown({"name", "description", "system_prompt", "prompts", "family", "speaker", "speaker_embedding"})
    family = _family_field(top)
    # A TTS prompt set has no Thinker: each prompt is the ``text`` to say (its WER reference), and the set
    # needs no system prompt. Its family's stage takes the text itself (``Family.text_input``).
    fam = get_family(family)
    tts = fam.text_input
    default_speaker = _speaker_field(top, fam, None)
    default_embedding = _embedding_field(top, fam, None)
    if default_speaker is not None and default_embedding is not None:
        raise top.fail("speaker_embedding", _BOTH_VOICES)
    system = top.str_("system_prompt", required=not tts, default="")
    items = top.data.get("prompts")
    if not isinstance(items, list) or not items:
        raise top.fail("prompts", "must be a non-empty list")
    seen: set[str] = set()
    prompts = []
    for i, item in enumerate(items):
        f = _Fields(path, item, f"prompts[{i}].")
        pid = f.str_("id", required=True)
        if tts:
            f.reject_unknown({"id", "text", "speaker", "speaker_embedding"})
            user = reply = f.str_("text", required=True)
        else:
            f.reject_unknown({"id", "user", "reply", "audio_seconds"})
            user = f.str_("user", required=True)
            reply = f.str_("reply", required=True)
        assert pid and user and reply
        key = "text" if tts else "reply"  # the file's own key names the field in every message
        if (bad := check_name(pid)) is not None:
            raise f.fail("id", bad)
        if (bad := _unspeakable(reply)) is not None:
            raise f.fail(key, bad)
        if pid in seen:
            raise f.fail("id", f"duplicate prompt id {short_repr(pid)}")
        seen.add(pid)
        n = len(tokenize(reply))
        # a Thinker says at most MAX_REPLY_TOKENS (the seed's greedy Thinker); a text-input family has no Thinker:
        # its texts are bounded by each deploy's max_model_len, checked before a run (text_fits)
        if not tts and n > MAX_REPLY_TOKENS:
            raise f.fail(key, f"{n} tokens, over the Thinker limit of {MAX_REPLY_TOKENS}")
        audio = f.float_("audio_seconds", 0.0, 0.0, 3600.0) or 0.0
        speaker = _speaker_field(f, fam, default_speaker) if tts else None
        embedding = _embedding_field(f, fam, default_embedding) if tts else None
        if speaker is not None and embedding is not None:
            raise f.fail("speaker_embedding" if f.has("speaker_embedding") else "speaker", _BOTH_VOICES)
        prompts.append(Prompt(id=pid, user=user, reply=reply, audio_seconds=audio, speaker=speaker,
                              speaker_embedding=embedding))
    _check_base_voices(path, prompts)
    assert system is not None
    return PromptSet(name=top.str_("name", default=path.stem) or path.stem,
                     description=top.str_("description", default="") or "",
                     system_prompt=system, prompts=tuple(prompts), path=path, family=family)


def _speaker_field(f: _Fields, family: Any, default: str | None) -> str | None:
    """``speaker:`` (the set's default, or one prompt's): a voice the family's release knows, by the name the
    release gives it (matched without case, as the serving layer lowercases a request's ``voice``)."""
    name = f.str_("speaker")
    if name is None:
        return default
    if not family.speakers:
        raise f.fail("speaker", f"family {family.name!r} takes no speaker in a prompt set")
    known = {s.lower(): s for s in family.speakers}
    if name.lower() not in known:
        raise f.fail("speaker", f"unknown speaker {short_repr(name)} (family {family.name!r} knows "
                                f"{', '.join(family.speakers)})")
    return known[name.lower()]


_BOTH_VOICES = ("a prompt takes speaker: (a CustomVoice checkpoint's voice) or speaker_embedding: (a Base "
                "checkpoint's), not both")
MAX_EMBEDDING = 4096  # the serving layer's bound on a request's speaker_embedding


def _embedding_field(f: _Fields, family: Any, default: tuple[float, ...] | None) -> tuple[float, ...] | None:
    """``speaker_embedding:`` (the set's default, or one prompt's): a Base voice as the x-vector itself, inline (a list
    of numbers) or a ``.npy`` file of one vector (a path relative to the prompt set's folder). Only its length is
    checked against a checkpoint, and only by the real backend (the Talker's hidden size); the sim takes any."""
    value = f.data.get("speaker_embedding")
    if value is None:
        return default
    if not family.speaker_embeddings:
        raise f.fail("speaker_embedding", f"family {family.name!r} takes no speaker embedding in a prompt set")
    if isinstance(value, str):
        values = _embedding_file(f, value)
    elif isinstance(value, list):
        bad = [v for v in value if isinstance(v, bool) or not isinstance(v, (int, float))]
        if bad:
            raise f.fail("speaker_embedding", f"must be numbers, got {short_repr(bad[0])}")
        values = [float(v) for v in value]
    else:
        raise f.fail("speaker_embedding", f"must be a list of numbers or a .npy file's path, got {short_repr(value)}")
    if not values or len(values) > MAX_EMBEDDING:
        raise f.fail("speaker_embedding", f"must hold 1 to {MAX_EMBEDDING} values, got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise f.fail("speaker_embedding", "values must be finite (no NaN or Inf)")
    return tuple(values)


def _embedding_file(f: _Fields, name: str) -> list[float]:
    """One vector from a ``.npy`` file (shape ``[n]`` or ``[1, n]``), read without pickles."""
    import numpy as np  # local: keeps config import-light

    path = Path(name) if Path(name).is_absolute() else f.source.parent / name
    if path.suffix != ".npy":
        raise f.fail("speaker_embedding", f"{name}: must be a .npy file (or a list of numbers)")
    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise f.fail("speaker_embedding", f"{path}: cannot be read as .npy ({exc})") from None
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1 or array.dtype.kind not in "fiu":
        raise f.fail("speaker_embedding", f"{path}: must hold one vector of numbers, got shape "
                                          f"{list(array.shape)} of {array.dtype}")
    return [float(v) for v in array.tolist()]


def _check_base_voices(path: Path, prompts: list[Prompt]) -> None:
    """A Base set: a checkpoint is either CustomVoice or Base (the server refuses the other task), so a set whose
    voices are speaker embeddings gives one to every prompt, all of one length (the Talker's hidden size)."""
    first = next((i for i, p in enumerate(prompts) if p.speaker_embedding is not None), None)
    if first is None:
        return
    size = len(prompts[first].speaker_embedding or ())
    for i, p in enumerate(prompts):
        if p.speaker_embedding is None:
            raise ConfigError(f"{path}: prompts[{i}].speaker_embedding: missing; prompts[{first}] gives its voice as a "
                              "speaker embedding (a Base checkpoint's), so every prompt needs one (or the set's "
                              "speaker_embedding:)")
        if len(p.speaker_embedding) != size:
            raise ConfigError(f"{path}: prompts[{i}].speaker_embedding: {len(p.speaker_embedding)} values, but "
                              f"prompts[{first}]'s has {size} (a checkpoint takes one size: its Talker's hidden size)")


def text_fits(prompts: PromptSet, prompt_lens: list[int], deploy: Deploy, max_model_len: int) -> None:
    """A text-input family's texts against one deploy: every position that carries text (the ``P`` prompt rows
    and one row per text token after them) must fit the deploy's ``max_model_len`` (its resolved value), so a
    long text is refused before a run, naming the prompt and the deploy, not cut short in it."""
    from harness.tokenizer import tokenize  # local: keeps config import-light

    for i, (prompt, P) in enumerate(zip(prompts.prompts, prompt_lens)):
        n = len(tokenize(prompt.reply))
        if P + n > max_model_len:
            raise ConfigError(f"{prompts.path}: prompts[{i}].text: {n} tokens after the {P} prompt rows need "
                              f"{P + n} positions, over {deploy.path}: talker.max_model_len {max_model_len} "
                              f"(prompt {prompt.id!r})")


# What the sim's tokenizer (harness.tokenizer: ASCII letters and digits make words, every other
# character is a pause) splits or drops while Whisper's normaliser (the WER reference) keeps it:
# a number with a decimal point or thousands separator ("3.5" spoken "3 5", "1,000" spoken "1 000"
# but scored "1000"), a decimal without its leading digit (".5"), the symbols the normaliser keeps
# ($ % ¢ € £), and an ellipsis (the normaliser can keep it as a word ".": "end..." scores "end .").
_NUMBER_RE = re.compile(r"\d+(?:[.,]\d+)+|(?<![A-Za-z0-9.])\.\d+")
_KEPT_SYMBOLS = "$%¢€£"
_ELLIPSIS_RE = re.compile(r"\.{2,}|\u2026")


def _unspeakable(reply: str) -> str | None:
    """Replies are English (the WER reference) and the sim must say each word of a reply as the
    scoring reads it, else a correct Talker scores as a mismatch (``pr`` got WER 0.9 on a Cyrillic
    reply, 0.437 on replies with "3.5", "café", "$", "%", "1,000", zero-width spaces: issue 24 case
    14). Refused at load, naming the first such character (or number), instead of mis-scored. The
    default prompt sets hold none of them, so their records are unchanged."""
    found: list[tuple[int, str]] = []
    if (m := _NUMBER_RE.search(reply)) is not None:
        spoken = " ".join(re.findall(r"\d+", m.group()))
        found.append((m.start(), f"number {m.group()!r} is spoken by the sim as {spoken!r} while WER scoring reads "
                                  f"it whole; write the number in words (e.g. 'three point five', 'one thousand')"))
    if (m := _ELLIPSIS_RE.search(reply)) is not None:
        found.append((m.start(), f"ellipsis {m.group()!r}: WER scoring can keep it as a word ('.') that the sim never "
                                  "says; write one period or a comma"))
    for i, ch in enumerate(reply):
        if found and i >= min(found)[0]:
            break
        if (bad := _unspeakable_char(reply, i, ch)) is not None:
            found.append((i, bad))
            break
    return min(found)[1] if found else None


def _unspeakable_char(reply: str, i: int, ch: str) -> str | None:
    code = f"U+{ord(ch):04X}"
    name = unicodedata.name(ch, "unnamed").lower()
    if ch in _KEPT_SYMBOLS:
        word = {"$": "dollars", "%": "percent", "¢": "cents", "€": "euros", "£": "pounds"}[ch]
        return (f"symbol {ch!r} ({code}, {name}): the sim does not speak it while WER scoring keeps it; "
                f"write it as a word ({word!r})")
    if ord(ch) < 0x80:
        return None
    category = unicodedata.category(ch)
    if category.startswith("L") and "LATIN" not in name.upper():
        return (f"letter {ch!r} ({code}, {name}) is not Latin script; "
                "replies are scored as English (Latin letters) and the sim speaks English only")
    if category.startswith(("L", "M")):
        start = i
        while start > 0 and (reply[start - 1].isalnum() or unicodedata.category(reply[start - 1]).startswith("M")):
            start -= 1
        end = i + 1
        while end < len(reply) and (reply[end].isalnum() or unicodedata.category(reply[end]).startswith("M")):
            end += 1
        word = reply[start:end]
        plain = "".join(c for c in unicodedata.normalize("NFKD", word) if c.isascii())
        what = f"letter {ch!r}" if category.startswith("L") else "combining mark"
        return (f"{what} ({code}, {name}) in {word!r}: the sim speaks ASCII letters only and would split or drop it "
                f"while WER scoring reads {plain!r}; write {plain!r}")
    if category.startswith("N"):
        return (f"character {ch!r} ({code}, {name}): the sim does not speak it while WER scoring reads it as a "
                "number; write it in words")
    if category.startswith("C"):  # never echoed: a zero-width space, a joiner, a byte-order mark
        return (f"invisible character {code} ({name}): the sim splits the word there while WER scoring keeps it "
                "inside the word; remove it")
    return None


def _resolve(name_or_path: str, folder: Path, what: str) -> Path:
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not candidate.exists():
            raise ConfigError(f"{candidate}: {what} file not found")
        return candidate
    path = folder / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(list_yaml(folder, exclude=NOT_DEPLOYS)) or "none"
        raise ConfigError(f"unknown {what} {name_or_path!r} (known: {known}; or give a .yaml path)")
    return path


# deploy_configs/ files that are not deploys: the arms file and the gate rules (gates.yaml, gates-<family>.yaml)
NOT_DEPLOYS = ("arms", "gates", "gates-*")


def list_yaml(folder: Path, exclude: tuple[str, ...] = ()) -> list[str]:
    """The stems of ``folder``'s YAML files, without those matching an ``exclude`` pattern (fnmatch)."""
    import fnmatch

    return sorted(p.stem for p in folder.glob("*.yaml") if not any(fnmatch.fnmatchcase(p.stem, x) for x in exclude))
