"""The vllm-omni backend: one real server per (arm, deploy, repeat), all prompts in flight, spans traced.

``run_cell`` emits the same ``RequestRecord``/``SpanRecord`` as the sim, so ASR, scoring, reports and
the gate are shared. Per cell it writes, under the run directory:

* ``server-<arm>-<deploy>.log``: the server's stdout+stderr (appended per repeat, with a header line
  carrying the exact command line);
* ``serve/<arm>-<deploy>-r<repeat>/trace-<pid>.jsonl``: the trace plugin's raw lines
  (``harness.serve.trace_plugin``; ``OMNI_STRESS_TRACE`` points the server there);
* ``serve/<arm>-<deploy>-r<repeat>/attempts.jsonl``: one line per HTTP attempt (retries, errors);
* ``audio/<arm>-<deploy>-r<repeat>-<prompt_id>.wav``: the Code2Wav audio of each request.

Each family's serving module (``Family.serve()``) supplies the deploy translation (Qwen2.5-Omni:
``--stage-overrides``; Qwen3-TTS: a whole ``--deploy-config`` YAML, written into the cell's folder), the
request body (chat completions, ``/v1/audio/speech``) and the oracle read-back; a family whose API names
its requests itself (``BY_TEXT``: Qwen3-TTS) has its trace lines filed by their text (``tts_text``).

Trace lines are matched to prompts by the unique token in each request's id (``client.make_tag``):
vLLM-Omni derives every stage's engine request id from ``chatcmpl-<X-Request-Id>`` (vLLM's
``InputProcessor.assign_request_id`` appends ``-<8 hex>``), so the token survives. Lines that match
no request (profiling or warm-up calls) are ignored. A retried request is sent with its own id
(``<id>-a2``) carrying the same token, so the spans of every attempt count for its prompt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.backends import CellOutcome, safe_name, wav_rel_path
from harness.config import ArmSpec, Deploy, Prompt, PromptSet, ServeSettings
from harness.contract import count_events
from harness.errors import UserError
from harness.family import get_family
from harness.records import CRASHED_ERROR as CRASHED, RequestRecord, SpanRecord, schedule_digest
from harness.audio.scoring import wer
from harness.stream_metrics import StreamMetrics, stream_failure
from harness.serve import client as chat
from harness.serve.deploy_args import DEPLOY_FILE, DeployTranslation, detect_platform
from harness.serve.launcher import HOST, ServerLauncher, progress
from harness.serve.releases import arm_release, installed_release, pick_python, release_problem
from harness.speaking.checkpoint import MARKER
from harness.serve.trace_plugin import (DEFAULT_LEVEL, DEFAULT_TARGET, ENV_ARM, ENV_DIR, ENV_LEVEL, ENV_ROW_IDS,
                                        ENV_TARGET, IMPLEMENTATION_GLOB, TRACE_GLOB, trace_level)
from harness.serve.chunk_trace import CHUNK_GLOB, ENV_CHUNKER, ENV_CHUNKER_ARM

BACKEND = "vllm-omni"
CLI_MODULE = "vllm.entrypoints.cli.main"  # `vllm serve ... --omni` delegates to vllm_omni (maybe_run_omni)
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "omni_stress_trace"


@dataclass
class ServeOptions:
    model: str = "Qwen/Qwen2.5-Omni-7B"  # local path or name the server resolves itself
    health_timeout_s: float = 1800.0
    request_timeout_s: float = 900.0
    stall_timeout_s: float = 0.0  # --stall-timeout: a streamed answer silent this long mid-stream fails (0: off)
    retries: int = 1
    extra_args: tuple[str, ...] = ()
    platform: str = "auto"  # gpu, cpu, or auto (harness.serve.deploy_args.detect_platform)
    default_python: str | None = None  # for arms without a serve: entry (--serve-python)
    trace_level: str = DEFAULT_LEVEL  # --trace: off, spans or contract (harness.serve.trace_plugin.LEVELS)
    stream: bool = False  # --stream: stream: true, the audio measured as it arrives (docs/streaming.md)

    @property
    def resolved_platform(self) -> str:
        return detect_platform() if self.platform == "auto" else self.platform

    @functools.cached_property
    def speaking(self) -> bool:
        """Read once: every request body and every cell's translation asks."""
        return is_speaking_checkpoint(self.model)

    def translate(self, deploy: Deploy) -> DeployTranslation:
        return family_serve_module(deploy.family).translate(deploy, self.resolved_platform, self.speaking)


def family_serve_module(family: str) -> Any:
    """The family's real-backend module (``Family.serve``: its deploy translation, request body, oracle)."""
    return get_family(family).serve()


SPEAKING_MARKER = MARKER  # written by ``omni-stress tiny-model`` (harness.speaking.checkpoint.write_marker)


def is_speaking_checkpoint(model: str) -> bool:
    """True for a local speaking tiny checkpoint: its Thinker needs the reply forcer, and its codec
    stream decodes to text (the family's ``speaking`` rules)."""
    marker = Path(model).expanduser() / SPEAKING_MARKER
    try:
        return bool(json.loads(marker.read_text(encoding="utf-8")).get("speaking"))
    except (OSError, ValueError, AttributeError):
        return False


DEFAULT_SERVE_PYTHON = ".venv-omni/bin/python"  # what scripts/install-real-cpu.sh builds
ENV_SERVE_PYTHON = "OMNI_STRESS_SERVE_PYTHON"


def default_serve_python(options: ServeOptions | None = None) -> str | None:
    """The interpreter for arms without a ``serve:`` entry: ``--serve-python``, then
    ``$OMNI_STRESS_SERVE_PYTHON``, then ``./.venv-omni/bin/python`` or the checkout's own."""
    if options is not None and options.default_python:
        return options.default_python
    if os.environ.get(ENV_SERVE_PYTHON):
        return os.environ[ENV_SERVE_PYTHON]
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (base / DEFAULT_SERVE_PYTHON).exists():
            return str(base / DEFAULT_SERVE_PYTHON)
    return None


# ---------------------------------------------------------------------------- paths and command




def server_log_path(run_dir: Path, arm: ArmSpec, deploy: Deploy) -> Path:
    return Path(run_dir) / f"server-{safe_name(arm.name)}-{safe_name(deploy.name)}.log"


def cell_dir(run_dir: Path, arm: ArmSpec, deploy: Deploy, repeat: int | str) -> Path:
    return Path(run_dir) / "serve" / f"{safe_name(arm.name)}-{safe_name(deploy.name)}-r{repeat}"


def audio_rel_path(arm: ArmSpec, deploy: Deploy, repeat: int, prompt_id: str) -> str:
    return wav_rel_path(arm.name, deploy.name, repeat, prompt_id)


def serve_settings(arm: ArmSpec, options: ServeOptions | None = None) -> ServeSettings:
    """The arm's ``serve:`` entry, the environment of the release it names (``harness.serve.releases``), or
    the default real environment (``default_serve_python``)."""
    if arm.serve is not None and (arm.serve.python or arm.serve.command):
        return arm.serve
    release = arm_release(arm)
    if release is not None:
        python = pick_python(release, default_serve_python(options), (Path.cwd(), Path(__file__).resolve().parents[2]))
        return dataclasses.replace(arm.serve or ServeSettings(), python=python, release=release)
    python = default_serve_python(options)
    if python is None:
        raise UserError(
            f"arm '{arm.name}' has no 'serve' entry in deploy_configs/arms.yaml and there is no default real "
            f"environment ({DEFAULT_SERVE_PYTHON}: run scripts/install-real-cpu.sh, or give --serve-python); or add "
            "'python' (the interpreter of a venv that has its vLLM-Omni) or 'command' to the arm's serve entry"
        )
    return ServeSettings(python=python)


def _resolve_python(python: str) -> str:
    """A relative interpreter path is taken from the working directory, else from this checkout."""
    path = Path(os.path.expanduser(python))
    if path.is_absolute() or path.exists():
        return str(path)
    in_checkout = Path(__file__).resolve().parents[2] / path
    return str(in_checkout) if in_checkout.exists() else str(path)


def server_prefix(arm: ArmSpec, options: ServeOptions | None = None) -> list[str]:
    """``[python, -m, vllm.entrypoints.cli.main]`` or the arm's command prefix (e.g. ``[/venv/bin/vllm]``)."""
    serve = serve_settings(arm, options)
    if serve.command:
        return [os.path.expanduser(serve.command[0]), *serve.command[1:]]
    assert serve.python is not None
    return [_resolve_python(serve.python), "-m", CLI_MODULE]


def _existing_python(arm: ArmSpec, serve: ServeSettings) -> str:
    assert serve.python is not None
    python = _resolve_python(serve.python)
    if not Path(python).exists():
        raise UserError(f"arm '{arm.name}': interpreter {python!r} not found (run scripts/install-real-cpu.sh, "
                        "give --serve-python, or fix the arm's serve: python)")
    return python


def preflight_arm(arm: ArmSpec, options: ServeOptions | None = None) -> None:
    """Before any run directory exists: the arm's interpreter exists and has this package's plugin, and a
    chunker arm is of a family whose connector windows the server traces."""
    if arm.chunker and not getattr(family_serve_module(arm.family), "CHUNKER", None):
        raise UserError(f"arm '{arm.name}': chunker {arm.chunker}: family {arm.family} has no Talker -> Code2Wav "
                        "window builder to replace (only a streaming family's async_chunk connector has one)")
    serve = serve_settings(arm, options)
    if serve.command:
        server_prefix(arm, options)
        return
    python = _existing_python(arm, serve)
    problem = check_plugin_installed(python)
    if problem:
        raise UserError(f"arm '{arm.name}': {problem}")
    release = arm_release(arm)
    if release is not None and (problem := release_problem(arm.name, release, python)):
        raise UserError(problem)


def binds_arm(arm: ArmSpec, options: ServeOptions | None = None) -> bool:
    """Whether the server binds this arm onto the installed model (``harness.serve.arm_binding``):
    a ``module:attr`` arm whose serve entry does not say ``bind_arm: false``; an upstream
    ``vllm-omni:`` arm is what the environment has installed."""
    return serve_settings(arm, options).bind_arm and not arm.talker.startswith("vllm-omni:")


def server_argv(arm: ArmSpec, deploy: Deploy, options: ServeOptions, port: int | str,
                deploy_file: Path | str | None = None) -> list[str]:
    """The exact command line: ``... serve MODEL --omni --host 127.0.0.1 --port N <deploy> <extra>``;
    ``deploy_file``: where a family's deploy YAML was written (``DeployTranslation.deploy_yaml``)."""
    translation = options.translate(deploy)
    args = [str(deploy_file) if a == DEPLOY_FILE and deploy_file is not None else a for a in translation.cli_args]
    return [
        *server_prefix(arm, options), "serve", options.model, "--omni", "--host", HOST, "--port", str(port),
        *args, *options.extra_args,
    ]


def server_env_overrides(arm: ArmSpec, trace_dir: Path, options: ServeOptions | None = None,
                         translation: DeployTranslation | None = None) -> dict[str, str]:
    """What the server's environment adds to ours: the platform's variables, the arm's ``env``, the
    trace directory and, for a bound arm, ``OMNI_STRESS_ARM``."""
    serve = serve_settings(arm, options)
    env = dict(translation.env) if translation is not None else {}
    env.update(serve.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[ENV_DIR] = str(trace_dir)
    if binds_arm(arm, options):
        env[ENV_ARM] = arm.talker
    if options is not None and options.speaking:  # its rows leave ROW_ID_DIMS at zero: identities (issue 32)
        env[ENV_ROW_IDS] = "1"
    target = get_family(arm.family).trace_target
    if target != DEFAULT_TARGET:  # the plugin's default is Qwen2.5-Omni's Talker
        env[ENV_TARGET] = target
    env.update(family_serve_module(arm.family).server_env())  # the family's hook (the arm binds it) and wrapper
    if options is not None and options.trace_level != DEFAULT_LEVEL:  # --trace; the default leaves the arm's env
        env[ENV_LEVEL] = options.trace_level                          # (an older OMNI_STRESS_CONTRACT=0) in force
    return env


def chunker_env(arm: ArmSpec, deploy: Deploy) -> dict[str, str]:
    """A streaming deploy of a family with a connector chunker: the window builder the Talker worker traces
    (``harness.serve.chunk_trace``), and the arm's own chunker when it has one."""
    chunker = getattr(family_serve_module(deploy.family), "CHUNKER", None)
    env = {ENV_CHUNKER: chunker} if deploy.async_chunk and chunker else {}
    if arm.chunker:
        env[ENV_CHUNKER_ARM] = arm.chunker
    return env


def cell_trace_level(env: dict[str, str]) -> str:
    """The level the cell's server traces at, from its environment (``--trace``, or the arm's serve env)."""
    return trace_level(env)


ENV_PREFIX = "OMNI_STRESS_"


def server_env(arm: ArmSpec, trace_dir: Path, options: ServeOptions | None = None,
               translation: DeployTranslation | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's whole environment: ours (``base``, default ``os.environ``) without any
    ``OMNI_STRESS_*`` variable, plus ``server_env_overrides``. Every ``OMNI_STRESS_*`` a server sees
    is set here for it (the trace directory, the bound arm, the arm's serve ``env``), never inherited:
    a stray ``OMNI_STRESS_ARM`` in the shell would bind an arm into a ``bind_arm: false`` server."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith(ENV_PREFIX)}
    env.update(server_env_overrides(arm, trace_dir, options, translation))
    return env


def check_plugin_installed(python: str, timeout_s: float = 60.0) -> str | None:
    """None if ``python`` sees this package's ``vllm.general_plugins`` entry point, else why not.

    Without it the server runs fine but traces nothing, and the event columns would silently read 0.
    """
    import subprocess

    code = (
        "import importlib.metadata as m, sys\n"
        f"eps = m.entry_points(group={PLUGIN_GROUP!r})\n"
        f"sys.exit(0 if any(e.name == {PLUGIN_NAME!r} for e in eps) else 3)\n"
    )
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return f"interpreter {python!r} not found"
    except subprocess.TimeoutExpired:
        return f"interpreter {python!r} did not answer within {timeout_s:g} s"
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return (f"the omni-stress trace plugin is not installed in {python} (entry point {PLUGIN_GROUP}:"
                f"{PLUGIN_NAME}); run: {python} -m pip install --no-deps -e <path to omni-stress>")
    return f"{python} failed: {proc.stderr.decode(errors='replace').strip()[-300:]}"


def describe_cell(arm: ArmSpec, deploy: Deploy, run_dir: Path, options: ServeOptions) -> str:
    """For ``--dry-run``: the exact command line, environment and files of one cell (nothing started)."""
    # A dry run describes what would run, also on a machine without the interpreter (a GPU host's
    # environment, or .venv-omni not installed here): a line says so; only a real run refuses.
    missing = None
    if arm.serve is None and default_serve_python(options) is None:
        options = dataclasses.replace(options, default_python=DEFAULT_SERVE_PYTHON)
    serve = serve_settings(arm, options)
    if serve.command:
        if shutil.which(os.path.expanduser(serve.command[0])) is None:
            missing = f"command {serve.command[0]!r}"
    elif serve.python is not None and not Path(_resolve_python(serve.python)).exists():
        missing = f"interpreter {_resolve_python(serve.python)!r}"
    translation = options.translate(deploy)
    run_dir = Path(run_dir).resolve()  # as run_cell: the server gets absolute paths
    trace = cell_dir(run_dir, arm, deploy, "<repeat>")
    env = {**server_env_overrides(arm, trace, options, translation), **chunker_env(arm, deploy)}
    argv = server_argv(arm, deploy, options, "$PORT")
    cmd = shlex.join(argv).replace("'$PORT'", "$PORT")
    env_text = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    placeholder = Prompt(id="<prompt_id>", user="<user text of the prompt>", reply="")
    prompt_set = PromptSet(name="<prompts>", description="", system_prompt="<system_prompt of the prompt set>",
                           prompts=(placeholder,), path=Path("<prompts>"))
    example = request_body(options, prompt_set, placeholder, deploy, "omni-stress-<prompt_id>-<hex32>")
    lines = [
        f"# arm {arm.name!r} x deploy {deploy.name!r} ({deploy.path}) -- backend vllm-omni, platform "
        f"{translation.platform}" + (f", arm {arm.talker} bound onto the installed model" if binds_arm(arm, options)
                                    else ", the installed vLLM-Omni as it is")
        + (f" (release {release}: that environment must hold it)" if (release := arm_release(arm)) else ""),
        "# server ($PORT: a free port on 127.0.0.1 picked at launch; own process group; stopped with SIGINT -> SIGTERM -> SIGKILL)",
        *([f"# {missing} is not installed here: a real run on this machine refuses (run scripts/install-real-cpu.sh, "
           "give --serve-python, or fix the arm's serve: entry)"] if missing else []),
        f"# environment: this shell's, without its {ENV_PREFIX}* variables, plus:",
        f"env {env_text} \\",
        f"  {cmd}",
        *((f"# {DEPLOY_FILE} (--deploy-config; {translation.platform} profile), written into the cell's folder:",
           *("#   " + ln for ln in translation.deploy_yaml.splitlines())) if translation.deploy_yaml is not None else
          (f"# --stage-overrides (stage 0 Thinker, 1 Talker, 2 Code2Wav; {translation.platform} profile), on top of "
           "the arm's default deploy/qwen2_5_omni.yaml:",
           *("#   " + ln for ln in json.dumps(translation.stage_overrides, indent=2, sort_keys=True).splitlines()))),
        f"# health: GET http://{HOST}:$PORT/health (timeout {options.health_timeout_s:g} s)",
        (f"# requests: POST http://{HOST}:$PORT{get_family(deploy.family).request_api}, every prompt in flight, timeout "
         f"{options.request_timeout_s:g} s, retries {options.retries}, header X-Request-Id: <request_id>; body of each:"),
        *(f"#   {key}: {json.dumps(value)}" for key, value in example.items() if key != "sampling_params_list"),
        *(("#   sampling_params_list (Thinker, Talker, Code2Wav):",
           *(f"#     {json.dumps(stage)}" for stage in example["sampling_params_list"]))
          if "sampling_params_list" in example else ()),
        "# files:",
        f"#   {server_log_path(run_dir, arm, deploy)}  (server log)",
        f"#   {trace}/trace-<pid>.jsonl  (Talker spans, trace plugin)",
        f"#   {trace}/attempts.jsonl  (HTTP attempts)",
        # wav_rel_path would make "<prompt_id>" file-name safe: a placeholder stands in for it
        f"#   {Path(run_dir) / wav_rel_path(arm.name, deploy.name, '<repeat>', 'PROMPT')}  (audio)".replace(
            "PROMPT", "<prompt_id>"),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- trace collection


class TraceCollector:
    """Reads the plugin's ``trace-*.jsonl`` incrementally (complete lines only) and files lines by prompt."""

    def __init__(self, directory: Path, token_to_prompt: dict[str, str],
                 text_to_prompt: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.token_to_prompt = token_to_prompt
        # the speech API names its requests itself (``speech-<uuid>``): lines say their text (``tts_text``)
        self.text_to_prompt = text_to_prompt or {}
        self._offsets: dict[Path, int] = {}
        self.by_prompt: dict[str, list[dict[str, Any]]] = {}
        self.rid_to_prompt: dict[str, str] = {}  # engine request id -> prompt id, from the Talker's lines
        self.chunks_by_prompt: dict[str, list[dict[str, Any]]] = {}  # the connector's windows (chunk_trace)
        self._pending_chunks: list[dict[str, Any]] = []
        self.unmatched = 0
        self.unusable = 0
        self.total = 0

    def _match(self, request_id: str) -> str | None:
        for token, prompt_id in self.token_to_prompt.items():
            if token in request_id:
                return prompt_id
        return None

    def _new_lines(self, pattern: str) -> Iterator[dict[str, Any]]:
        """The complete lines appended to the files matching ``pattern`` since the last read, parsed (an
        unparsable line is counted, not returned)."""
        for path in sorted(self.directory.glob(pattern)):
            start = self._offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n") + 1
            if end <= 0:
                continue
            self._offsets[path] = start + end
            for raw in data[:end].splitlines():
                if not raw.strip():
                    continue
                try:
                    yield json.loads(raw)
                except json.JSONDecodeError:
                    self.unusable += 1

    def poll(self) -> None:
        for line in self._new_lines(TRACE_GLOB):
            self.total += 1
            prompt_id = self._match(str(line.get("request_id")))
            if prompt_id is None and isinstance(line.get("tts_text"), str):
                prompt_id = self.text_to_prompt.get(line["tts_text"])
            if prompt_id is None:
                self.unmatched += 1
                continue
            self.rid_to_prompt[str(line.get("request_id"))] = prompt_id
            self.by_prompt.setdefault(prompt_id, []).append(line)
        self._poll_chunks()

    def _poll_chunks(self) -> None:
        """The connector's windows (``chunk_trace``): filed by the engine request id the Talker's lines
        named (a window follows its request's Talker step, so its id is known by then)."""
        self._pending_chunks.extend(self._new_lines(CHUNK_GLOB))
        waiting = []
        for line in self._pending_chunks:
            rid = str(line.get("request_id"))
            prompt_id = self.rid_to_prompt.get(rid) or self._match(rid)
            if prompt_id is None:
                waiting.append(line)
            else:
                self.chunks_by_prompt.setdefault(prompt_id, []).append(line)
        self._pending_chunks = waiting

    def take(self, prompt_id: str) -> list[dict[str, Any]]:
        lines = self.by_prompt.pop(prompt_id, [])
        lines.sort(key=lambda ln: (ln.get("pid") or 0, ln.get("seq") or 0))
        return lines

    def take_chunks(self, prompt_id: str) -> list[dict[str, Any]]:
        """The request's windows in sending order."""
        lines = self.chunks_by_prompt.pop(prompt_id, [])
        lines.sort(key=lambda ln: (ln.get("pid") or 0, ln.get("seq") or 0))
        return lines


def span_from_line(line: dict[str, Any], arm: str, deploy: str, repeat: int, prompt_id: str) -> SpanRecord | None:
    """One trace line as a ``SpanRecord``; None when the runner passed no metadata (nothing to classify)."""
    P, c, n = line.get("_omni_prompt_len"), line.get("_omni_num_computed_tokens"), line.get("span_len")
    if not all(isinstance(v, int) for v in (P, c, n)) or n < 1 or P < 0 or c < 0:
        return None
    rows = line.get("rows")
    error = line.get("error")
    rows_i = int(rows) if isinstance(rows, int) else 0  # a call that raised delivered no rows
    if not isinstance(error, str) and isinstance(line.get("contract_error"), str):
        error = f"contract check: {line['contract_error']}"  # the worker could not build the expected rows

    def count(key: str) -> int | None:  # the worker's contract check, when the trace has it
        value = line.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    return SpanRecord(  # the record computes its event flags from the contract itself
        arm=arm, deploy=deploy, repeat=repeat, request=prompt_id, step=int(line.get("step") or 0),
        P=P, c=c, n=n, rows=rows_i, misaligned_text=count("misaligned_text"), misaligned_end=count("misaligned_end"),
        error=error if isinstance(error, str) else None,
    )


# ---------------------------------------------------------------------------- run one cell


@dataclass
class ServeCell:
    """One real cell, built and not yet run: the server's command line, environment, log and trace
    folder, the requests to send, and what the trace has told so far (``build_cell``, ``step_cell``)."""

    arm: ArmSpec
    deploy: Deploy
    repeat: int
    run_dir: Path
    options: ServeOptions
    trace: Path
    log_path: Path
    env: dict[str, str]
    specs: list[chat.RequestSpec]
    collector: TraceCollector
    replies: dict[str, str] = field(default_factory=dict)  # prompt id -> the prompt set's reply
    codecs: dict[str, dict[int, int]] = field(default_factory=dict)  # prompt id -> position -> codec id
    generated_at: dict[str, list[float]] = field(default_factory=dict)  # prompt id -> times of generated calls
    # prompt id -> its text region past the prompt, as the worker's contract check built it (``text_len``)
    text_lens: dict[str, int] = field(default_factory=dict)
    deploy_file: Path | None = None  # the family's deploy YAML (``--deploy-config``), when it has one

    @property
    def label(self) -> str:
        return f"vllm-omni server for arm '{self.arm.name}' deploy '{self.deploy.name}' (repeat {self.repeat})"

    def spans_for(self, prompt_id: str) -> list[SpanRecord]:
        """The request's traced spans not taken yet (its codec ids and generated-call times noted)."""
        out = []
        for line in self.collector.take(prompt_id):
            _collect_codec(self.codecs.setdefault(prompt_id, {}), line)
            if (at := generated_position_time(line)) is not None:
                self.generated_at.setdefault(prompt_id, []).append(at)
            text_len = line.get("text_len")
            if isinstance(text_len, int) and not isinstance(text_len, bool) and text_len >= 0:
                self.text_lens.setdefault(prompt_id, text_len)
            span = span_from_line(line, self.arm.name, self.deploy.name, self.repeat, prompt_id)
            if span is None:
                self.collector.unusable += 1
            else:
                out.append(span)
        return out

    @property
    def traces_chunks(self) -> bool:
        """The server traces its connector's windows (a streaming deploy of a family with a chunker)."""
        return bool(self.env.get(ENV_CHUNKER)) and cell_trace_level(self.env) != "off"

    def record(self, res: chat.ChatResult, spans: list[SpanRecord]) -> RequestRecord:
        record = _record(self.arm, self.deploy, self.repeat, self.run_dir, res, spans,
                         self.codecs.get(res.prompt_id, {}), self.options.speaking,
                         self.generated_at.get(res.prompt_id, ()), self.replies.get(res.prompt_id),
                         self.text_lens.get(res.prompt_id))
        if self.traces_chunks and res.error is None:
            self.collector.poll()  # the windows of a finished request are all written by now
            others = {pid: [c for _, c in sorted(codes.items())] for pid, codes in self.codecs.items()
                      if pid != res.prompt_id}
            chunk_fields(record, self.collector.take_chunks(res.prompt_id),
                         family_serve_module(self.deploy.family).chunk_rule(), others)
        return record


def build_cell(arm: ArmSpec, deploy: Deploy, prompts: PromptSet, repeat: int, run_dir: Path,
               options: ServeOptions) -> ServeCell:
    """Everything a cell needs before its server starts; refuses an untranslatable deploy or an arm
    environment without the trace plugin first, and clears a previous attempt's trace."""
    serve = serve_settings(arm, options)
    translation = options.translate(deploy)  # refuse untranslatable deploys first
    run_dir = Path(run_dir).resolve()  # the server gets absolute paths whatever its working directory
    if serve.python and not serve.command:
        problem = check_plugin_installed(_resolve_python(serve.python))
        if problem:
            raise UserError(f"arm '{arm.name}': {problem}")
    trace = cell_dir(run_dir, arm, deploy, repeat)
    trace.mkdir(parents=True, exist_ok=True)
    for stale in [*trace.glob(TRACE_GLOB), *trace.glob(CHUNK_GLOB), *trace.glob(IMPLEMENTATION_GLOB),
                  trace / "attempts.jsonl"]:
        stale.unlink(missing_ok=True)  # a rerun of this cell must not see the previous server's spans
    (run_dir / "audio").mkdir(parents=True, exist_ok=True)
    deploy_file = None
    if translation.deploy_yaml is not None:
        deploy_file = trace / "deploy.yaml"
        deploy_file.write_text(translation.deploy_yaml, encoding="utf-8")
    specs: list[chat.RequestSpec] = []
    token_to_prompt: dict[str, str] = {}
    for p in prompts.prompts:
        tag = chat.make_tag(p.id)
        token_to_prompt[chat.tag_token(tag)] = p.id
        specs.append(chat.RequestSpec(
            prompt_id=p.id, tag=tag, body=request_body(options, prompts, p, deploy, tag),
            audio_file=run_dir / audio_rel_path(arm, deploy, repeat, p.id),
        ))
    text_to_prompt = {p.reply: p.id for p in prompts.prompts} if family_serve_module(deploy.family).BY_TEXT else None
    env = {**server_env(arm, trace, options, translation), **chunker_env(arm, deploy)}
    return ServeCell(arm, deploy, repeat, run_dir, options, trace, server_log_path(run_dir, arm, deploy),
                     env, specs,
                     TraceCollector(trace, token_to_prompt, text_to_prompt),
                     replies={p.id: p.reply for p in prompts.prompts}, deploy_file=deploy_file)


def request_body(options: ServeOptions, prompts: PromptSet, prompt: Prompt, deploy: Deploy, tag: str) -> dict[str, Any]:
    """One request's body, the family's (Qwen2.5-Omni's chat request, Qwen3-TTS's ``/v1/audio/speech``)."""
    return family_serve_module(deploy.family).request_body(options.model, prompts, prompt, deploy, tag,
                                                           options.speaking, options.stream)


# A cell's server is started at most this many times: after a crash the requests it had not been sent
# yet go to a new server; a server that keeps crashing leaves the rest of the cell unsent (errors).
MAX_SERVER_STARTS = 3


def step_cell(cell: ServeCell, on_request: Callable[[RequestRecord], None],
              on_spans: Callable[[list[SpanRecord]], None], seed: int = 0) -> dict[str, Any]:
    """Start the cell's server, send its requests, emit records as they complete, stop the server;
    returns where the time went (``server_start_s``, ``requests_s``, ``server_stop_s``) and the
    crashes (``crashes``: one entry per server that died during the requests).

    A server that dies during the requests (issue 31: the Talker crash on preempt and resume,
    vLLM-Omni #4471) is a finding, not the end of the run: every request it had been sent is an error
    record naming the crash (the last traceback line of its log), and the requests the load had not
    sent yet go to a new server, at most ``MAX_SERVER_STARTS`` servers per cell."""
    arm, deploy, repeat, options = cell.arm, cell.deploy, cell.repeat, cell.options
    emitted: list[RequestRecord] = []
    times: dict[str, Any] = {}
    crashes: list[dict[str, Any]] = []
    remaining = list(cell.specs)
    t0 = time.perf_counter()
    for start in range(1, MAX_SERVER_STARTS + 1):
        launcher = ServerLauncher(
            lambda port: server_argv(arm, deploy, options, port, cell.deploy_file), cell.log_path, env=cell.env,
            label=cell.label,
            health_timeout_s=options.health_timeout_s,
        )
        held_back: list[chat.RequestSpec] = []
        by_id = {spec.prompt_id: spec for spec in remaining}
        with launcher as server, open(cell.trace / "attempts.jsonl", "a", encoding="utf-8") as attempts_fh:
            t_healthy = time.perf_counter()
            times.setdefault("server_start_s", round(t_healthy - t0, 1))

            @functools.lru_cache(maxsize=1)
            def crash_text(code: int | None) -> str:  # read once per crash: every request gets the same line
                how = f"exit code {code}" if code is not None else "its engine core died"
                return f"{CRASHED} ({how}): {server.crash_line()}; log: {cell.log_path}"

            def gone() -> str:
                return crash_text(server.proc.poll() if server.proc is not None else None)

            def on_result(res: chat.ChatResult, held_back: list[chat.RequestSpec] = held_back,
                          by_id: dict[str, chat.RequestSpec] = by_id) -> None:
                if res.not_sent:
                    held_back.append(by_id[res.prompt_id])
                    return
                attempts_fh.writelines(
                    json.dumps({"prompt_id": res.prompt_id, **a}) + "\n" for a in res.attempts
                )
                attempts_fh.flush()
                cell.collector.poll()
                spans = cell.spans_for(res.prompt_id)
                if spans:
                    on_spans(spans)
                record = cell.record(res, spans)
                emitted.append(record)
                on_request(record)  # the caller shows per-request progress

            asyncio.run(chat.run_requests(
                server.base_url, remaining, request_timeout_s=options.request_timeout_s, retries=options.retries,
                stall_timeout_s=options.stall_timeout_s,
                on_result=on_result, server_alive=server.alive, server_gone_message=gone,
                load=deploy.load, seed=seed, path=get_family(deploy.family).request_api,
            ))
            times["requests_s"] = round(times.get("requests_s", 0.0) + time.perf_counter() - t_healthy, 1)
            t_stop = time.perf_counter()
            cell.collector.poll()
            leftovers = [s for pid in list(cell.collector.by_prompt) for s in cell.spans_for(pid)]
            if leftovers:
                on_spans(leftovers)
            crashed = not server.alive()
            if crashed:
                code = server.proc.poll() if server.proc is not None else None
                taken = sum(1 for r in emitted if r.error is not None and r.error.startswith(CRASHED))
                crashes.append({"server": start, "exit_code": code, "error": server.crash_line(),
                                "requests_in_flight": taken - sum(c["requests_in_flight"] for c in crashes),
                                "requests_not_sent": len(held_back)})
                how = f"exit code {code}" if code is not None else "its engine core died"
                progress(f"{cell.label}: the server crashed ({how}: {server.crash_line()}); "
                         f"{len(held_back)} request(s) not sent yet" + (", restarting it" if held_back else ""))
        times["server_stop_s"] = round(times.get("server_stop_s", 0.0) + time.perf_counter() - t_stop, 1)
        held = {spec.prompt_id for spec in held_back}
        remaining = [spec for spec in remaining if spec.prompt_id in held]  # in the cell's order, as first sent
        if not remaining:
            break
    for spec in remaining:  # the last server crashed too: what it was never sent is an error, once
        res = chat.ChatResult(prompt_id=spec.prompt_id, tag=spec.tag,
                              error=f"{CRASHED}: not sent, the cell's server crashed {len(crashes)} times "
                                    f"(at most {MAX_SERVER_STARTS} starts per cell); log: {cell.log_path}")
        record = cell.record(res, [])
        emitted.append(record)
        on_request(record)
    if crashes:
        times["crashes"] = crashes

    collector = cell.collector
    if cell_trace_level(cell.env) == "off":
        pass  # nothing was traced on purpose: the manifest and the report say so
    elif collector.total == 0 and any(r.error is None for r in emitted):
        progress(f"warning: no Talker spans were traced for {arm.name}/{deploy.name} r{repeat}: is omni-stress "
                 f"installed in the arm's environment (entry point {PLUGIN_GROUP}:{PLUGIN_NAME}) and is VLLM_PLUGINS "
                 "unset or listing it? The event columns will read 0.")
    elif collector.unmatched or collector.unusable:
        print(f"omni-stress: {arm.name}/{deploy.name} r{repeat}: ignored {collector.unmatched} trace lines of "
              f"unknown requests and {collector.unusable} without runner metadata", file=sys.stderr)
    return times


def run_cell(
    arm: ArmSpec,
    deploy: Deploy,
    prompts: PromptSet,
    repeat: int,
    run_dir: Path,
    options: ServeOptions,
    on_request: Callable[[RequestRecord], None],
    on_spans: Callable[[list[SpanRecord]], None],
    seed: int = 0,
) -> dict[str, float]:
    """Launch the arm's server with the deploy, send every prompt at once, emit records as they complete;
    returns where the cell's time went (``server_start_s``, ``requests_s``, ``server_stop_s``) and its
    server crashes (``crashes``, when any).

    Each ``RequestRecord`` is emitted once, right after its response (its Talker spans are already
    traced by then, so ``events`` is filled); its spans go to ``on_spans`` just before it. A server
    that dies mid-run: records already emitted stay, the requests it was sent are errors naming the
    crash, the ones not sent yet go to a restarted server (``step_cell``).
    """
    return step_cell(build_cell(arm, deploy, prompts, repeat, run_dir, options), on_request, on_spans, seed)


def chunk_fields(record: RequestRecord, lines: list[dict[str, Any]], rule: Any,
                 others: dict[str, list[int]]) -> None:
    """The request's windows as the connector sent them, checked against its codec stream
    (``harness.chunk_contract``)."""
    from harness.chunk_contract import Window, check_windows

    windows = [Window(tuple(int(f) for f in line.get("frames") or []), int(line.get("left_context") or 0),
                      bool(line.get("finished"))) for line in lines]
    result = check_windows(windows, record.codec_tokens, rule, others)
    record.chunk_windows, record.chunk_frames_sent = result.windows, list(result.frames_sent)
    record.chunk_violations, record.chunk_violation = result.count, result.first


def _collect_codec(stream: dict[int, int], line: dict[str, Any]) -> None:
    start, ids = line.get("codec_from"), line.get("codec_ids")
    if isinstance(start, int) and isinstance(ids, list):
        for i, code in enumerate(ids):
            if isinstance(code, int):
                stream[start + i] = code  # a replay re-feeds the same token: the last write is as good


def codec_stream(stream: dict[int, int], P: int | None) -> list[int]:
    """The Talker's codec tokens in order (position ``P + g`` holds token ``g``), up to the first gap."""
    if P is None:
        return []
    out = []
    while P + len(out) in stream:
        out.append(stream[P + len(out)])
    return out


def generated_position_time(line: dict[str, Any]) -> float | None:
    """The trace line's wall time when the call fed a generated position (``c >= P``: the Talker had
    sampled its first codec token by then), else None."""
    P, c, at = line.get("_omni_prompt_len"), line.get("_omni_num_computed_tokens"), line.get("time")
    if isinstance(P, int) and isinstance(c, int) and c >= P and isinstance(at, (int, float)) \
            and not isinstance(at, bool) and math.isfinite(at):
        return float(at)
    return None


def time_to_first_codec(res: chat.ChatResult, generated_at: Iterable[float]) -> float | None:
    """Seconds from the request's first send to the Talker's first call at a generated position
    during the attempt that answered (the client's and the worker's ``time.time()``, one host). The
    API is not streamed (``stream: false``): the audio arrives whole with the response, so this is
    the earliest a streaming API could have sent audio, not a measured time to first audio byte."""
    if res.error is not None or res.sent_at is None:
        return None
    since = res.answered_attempt_at if res.answered_attempt_at is not None else res.sent_at
    times = [t for t in generated_at if t >= since]
    return round(max(0.0, min(times) - res.sent_at), 3) if times else None


def stream_fields(record: RequestRecord, m: StreamMetrics, audio_events: int | None = None) -> None:
    """A streamed request's measured facts into its record (seconds since the answering attempt's
    send, to the microsecond): TTFA to the first audio bytes, every gap, each underrun and their total."""
    def us(x: float) -> float:
        return round(x, 6)

    record.stream_ttfa_s = us(m.ttfa_s) if m.ttfa_s is not None else None
    record.stream_end_s = us(m.end_s)
    record.stream_chunks = m.chunks
    record.stream_audio_events = audio_events
    record.stream_sample_rate = m.sample_rate
    record.stream_chunk_frames = list(m.chunk_frames)
    record.stream_gaps_s = [us(g) for g in m.gaps_s]
    record.stream_underruns = [[us(u.start_s), us(u.length_s)] for u in m.underruns]
    record.stream_underrun_s = us(m.underrun_s)


def reply_mismatch(prompt_id: str, expected: str | None, said: str | None) -> str | None:
    """The speaking checkpoint's Thinker is forced to say the prompt set's reply, which is then the
    WER reference: a Thinker that said something else would be scored against the wrong text, so the
    request is an error naming it (issue 32). ``None`` when they agree (up to surrounding space)."""
    if expected is None or said is None or said.strip() == expected.strip():
        return None
    from harness.errors import short_repr

    return (f"prompt {prompt_id!r}: the Thinker said {short_repr(said)}, not the prompt set's reply "
            f"{short_repr(expected)} (the speaking checkpoint's reply forcer did not hold; not scored)")


def _record(arm: ArmSpec, deploy: Deploy, repeat: int, run_dir: Path, res: chat.ChatResult,
            spans: list[SpanRecord], stream: dict[int, int] | None = None, speaking: bool = False,
            generated_at: Iterable[float] = (), expected_reply: str | None = None,
            text_len: int | None = None) -> RequestRecord:
    first = spans[0] if spans else None
    restarts = sum(1 for s in spans[1:] if s.c == 0)  # preemption by recompute resets c to 0
    audio = None
    if res.audio_file is not None:
        audio = os.path.relpath(res.audio_file, run_dir)
    record = RequestRecord(
        arm=arm.name, deploy=deploy.name, repeat=repeat, prompt_id=res.prompt_id, backend=BACKEND,
        reference_text=res.thinker_text or "", thinker_text=res.thinker_text,
        talker_prompt_len=first.P if first else None, finish_reason=res.finish_reason,
        audio_path=audio, audio_seconds=res.audio_seconds, preemptions=restarts,
        events=count_events(spans, text_len), error=res.error, wall_s=round(res.wall_s, 3), text_len=text_len,
    )
    if res.error is None and res.audio_seconds:  # real-time factor: seconds of work per second of audio
        record.rtf = round(res.wall_s / res.audio_seconds, 4)
    record.ttfa_s = time_to_first_codec(res, generated_at)
    if res.error is None and res.stream is not None:
        stream_fields(record, res.stream, res.audio_events)
        sent = res.answered_attempt_at if res.answered_attempt_at is not None else res.sent_at
        record.stream_sent_at = None if sent is None else round(sent, 6)
    if spans:
        record.schedule = schedule_digest(spans)
    codes = codec_stream(stream or {}, record.talker_prompt_len)
    record.codec_tokens, record.num_codec_tokens = codes, len(codes)
    serve = family_serve_module(deploy.family)
    per_frame = getattr(serve, "SAMPLES_PER_CODEC_FRAME", None)
    if res.error is None and res.stream is not None and per_frame:
        record.stream_failed = stream_failure(res.stream.frames, len(codes), per_frame,
                                              getattr(serve, "STREAM_END_TRIM", 0))
    if speaking and res.error is None and (problem := reply_mismatch(res.prompt_id, expected_reply,
                                                                     res.thinker_text)) is not None:
        record.error = problem
    elif speaking and res.error is None:  # the speaking model's oracle: its codec stream read back through the table
        record.oracle_transcript = family_serve_module(deploy.family).oracle(codes)
        record.oracle_wer = wer(record.reference_text, record.oracle_transcript)
    return record


def implementation_of(run_dir: Path, arm: ArmSpec, deploy: Deploy, repeat: int,
                      options: ServeOptions) -> dict[str, Any]:
    """What ran where, for the manifest: the server command's interpreter and platform, and what each
    worker that loaded the Talker reported (``implementation-<pid>.json``: the bound arm's file and
    hash, the model file and hash, package versions)."""
    workers = []
    for path in sorted(cell_dir(Path(run_dir).resolve(), arm, deploy, repeat).glob(IMPLEMENTATION_GLOB)):
        try:
            workers.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    serve = serve_settings(arm, options)
    release = installed_release(_resolve_python(serve.python)) if serve.python and not serve.command else None
    return {"server": server_prefix(arm, options)[0], "platform": options.resolved_platform,
            "arm": arm.talker if binds_arm(arm, options) else "installed vLLM-Omni",
            **({"release": release} if release else {}), "workers": workers}


class ServeBackend:
    """The real backend behind ``harness.backends.Backend``: one server per cell, records carry
    the server's audio (written by the client under ``audio/``)."""

    name = BACKEND

    def __init__(self, run_dir: Path, options: ServeOptions | None) -> None:
        self.run_dir = Path(run_dir)
        self.options = options or ServeOptions()

    def open(self, jobs: list[Any]) -> None:
        return None

    def run_cell(self, job: Any, emit: Callable[[RequestRecord], None],
                 emit_spans: Callable[[list[SpanRecord]], None], idle: Callable[[], None]) -> CellOutcome:
        t0 = time.perf_counter()

        def on_request(record: RequestRecord) -> None:
            if record.prompt_id not in job.skip:
                emit(record)

        cell = build_cell(job.arm, job.deploy, job.prompts, job.repeat, self.run_dir, self.options)
        times = step_cell(cell, on_request, emit_spans, seed=job.seed)
        crashes = times.pop("crashes", None)
        extra = {"implementation": implementation_of(self.run_dir, job.arm, job.deploy, job.repeat, self.options),
                 "serve_seconds": times, "trace": cell_trace_level(cell.env)}
        if crashes:
            extra["crashes"] = crashes  # the manifest's cells[].crashes: each server that died, and what it said
        return CellOutcome(seconds=time.perf_counter() - t0, extra=extra)

    def close(self, cancel: bool = False) -> None:
        return None
