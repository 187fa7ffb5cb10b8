"""The options ``omni-stress run`` and ``omni-stress sweep`` share: one definition each, in the order
``--help`` lists them, and ``RunArgs``, the same values typed once. Where the two commands mean
something different by an option (a sweep's repeat also redraws its arrivals, its ``--asr``
defaults to ``none``), the option carries one help text (or default) per command; an option only
one command has names that command.

``shared_run_options("run")`` / ``shared_run_options("sweep")`` add them to a Click command (the
executor's ``--executor`` / ``--ray-address`` included); the command adds its own options after
them and turns Click's values into ``RunArgs.from_click(values)`` first thing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import click

from harness.config import MAX_SEED
from harness.executors import EXECUTORS, get_executor
from harness.family import family_names
from harness.backends import BACKENDS, DEFAULT_SIM_TALKER, SIM_TALKERS
from harness.sim import armcall

TRACE_LEVELS = ("off", "spans", "contract")  # harness.serve.trace_plugin.LEVELS (that module stays stdlib-only)

COMMANDS = ("run", "sweep")


def finite_seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """A number of seconds: ``nan`` passes click's range checks (every comparison with it is false)
    and would disable the limit, ``inf`` waits forever, a negative number means nothing."""
    if value is not None and (math.isnan(value) or math.isinf(value) or value < 0):
        raise click.BadParameter(f"{value!r} is not a number of seconds (a finite number >= 0)", ctx, param)
    return value


def _address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        raise click.BadParameter("an address (HOST:PORT, ray://HOST:PORT) or 'auto'", ctx, param)
    return value


class _Opt:
    """One option: Click's declarations and keywords; ``per_command`` keywords that differ per command
    (``{"help": {"run": ..., "sweep": ...}}``); ``only``: the one command that has it."""

    def __init__(self, *decls: str, only: str | None = None, per_command: dict[str, dict[str, Any]] | None = None,
                 **kwargs: Any) -> None:
        self.decls, self.only, self.per_command, self.kwargs = decls, only, per_command or {}, kwargs

    def decorator(self, command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        kwargs = dict(self.kwargs)
        for key, by_command in self.per_command.items():
            kwargs[key] = by_command[command]
        return click.option(*self.decls, **kwargs)


_OPTIONS: tuple[_Opt, ...] = (
    _Opt("--arm", "arms", multiple=True, default=("main", "pr"), show_default=True,
         help="Arm from deploy_configs/arms.yaml, or NAME=package.module:attr. Repeatable."),
    _Opt("--arms-file", type=click.Path(path_type=Path), default=None,
         help="Arms YAML to resolve --arm names in (default deploy_configs/arms.yaml)."),
    _Opt("--deploy", "deploys", only="run", multiple=True, default=("reference", "stress"), show_default=True,
         help="Deploy name (deploy_configs/NAME.yaml) or a YAML path. Repeatable."),
    _Opt("--prompts", "prompt_set", default="default", show_default=True,
         help="Prompt set name (prompts/NAME.yaml) or a YAML path."),
    _Opt("--family", type=click.Choice(list(family_names())), default=None, per_command={"help": {
        "run": "Model family (harness/families/). Default: the deploys' (a deploy without family: is qwen2.5-omni's). "
               "Given, --arm, --deploy and --prompts default to the family's own.",
        "sweep": "Model family (default: the sweep's deploys'). Given, --arm and --prompts default to the "
                 "family's own."}}),
    _Opt("--repeat", type=click.IntRange(1, 100), default=1, show_default=True, per_command={"help": {
        "run": "Run each cell N times (the seed's run 1 / run 2).",
        "sweep": "Run each point N times; sim repeat r uses seed + r - 1 (its sampling and arrival jitter)."}}),
    _Opt("--seed", type=click.IntRange(0, MAX_SEED), default=42, show_default=True, per_command={"help": {
        "run": "Talker sampling seed; repeat r of a sim cell uses seed + r - 1.",
        "sweep": "Talker sampling seed, also the sim's arrival draws (jitter, Poisson gaps)."}}),
    _Opt("--out", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
         help="Folder for run directories."),
    _Opt("--run-id", default=None, per_command={"help": {
        "run": "Name of the run directory inside --out (letters, digits, '.', '_', '-'; default: timestamp, arms "
               "and a random suffix).",
        "sweep": "Name of the run directory inside --out (default: timestamp, 'sweep', the sweep's name and a "
                 "random suffix)."}}),
    _Opt("--resume", "resume_dir", type=click.Path(path_type=Path), default=None, per_command={"help": {
        "run": "Continue an interrupted run directory: completed requests are kept, the rest run.",
        "sweep": "Continue an interrupted sweep: recorded requests are kept, the rest run (same sweep file)."}}),
    _Opt("--backend", type=click.Choice(list(BACKENDS)), default="sim", show_default=True),
    _Opt("--sim-talker", type=click.Choice(list(SIM_TALKERS)), default=DEFAULT_SIM_TALKER, show_default=True,
         per_command={"help": {
             "run": "sim: the simulated Talker. 'words': the sim's own (speaks words, R frames per text token); "
                    "'speaking': the speaking tiny model's rules and byte tokenizer, as the real server runs them "
                    "(compare the two with `omni-stress fidelity`).",
             "sweep": "sim: the simulated Talker (see `omni-stress run --help`)."}}),
    _Opt("--asr", type=click.Choice(["faster-whisper", "openai-whisper", "none"]), show_default=True, per_command={
        "default": {"run": "faster-whisper", "sweep": "none"},
        "help": {"run": "'none' scores the oracle transcript only (no TTS, no Whisper).",
                 "sweep": "'none' scores the oracle transcript (a sweep has many cells; Whisper is available as "
                          "for run)."}}),
    _Opt("--asr-model", default="base", show_default=True, help="tiny.en, base, or a local model path."),
    _Opt("--beam-size", type=click.IntRange(1, 10), default=1, show_default=True),
    _Opt("--asr-workers", type=click.IntRange(0, 64), default=None, per_command={"help": {
        "run": "Whisper worker processes (default: 2 on 2+ cores; 0: transcribe in the run's own process).",
        "sweep": "Whisper worker processes (default: 2 on 2+ cores)."}}),
    _Opt("--asr-batch", type=click.IntRange(0, 64), default=0, show_default=True,
         help="faster-whisper: 0 transcribes each clip alone; N sends clips to each Whisper worker N at a time, "
              "decoded together by faster-whisper's batched pipeline (less CPU per clip; its transcripts differ "
              "slightly from per clip's, docs/audio.md)."),
    _Opt("--sim-workers", type=click.IntRange(0, 64), default=None, per_command={"help": {
        "run": "Sim cells simulated at once in forked processes (default: 2 on 2+ cores; 1: one at a time in one "
               "worker; 0: in the run's own process, where an arm call that ignores --arm-timeout cannot be ended).",
        "sweep": "Sim cells simulated at once in forked processes (default: 2 on 2+ cores)."}}),
    _Opt("--cache-dir", type=click.Path(path_type=Path), default=None,
         help="Transcript/model cache (default $OMNI_STRESS_CACHE_DIR or ~/.cache/omni-stress)."),
    _Opt("--no-cache", is_flag=True, help="Do not read or write the transcript cache on disk."),
    _Opt("--quiet", "-q", is_flag=True, help="No progress output."),
    _Opt("--dry-run", only="run", is_flag=True, help="vllm-omni backend: print the commands and files, run nothing."),
    _Opt("--model", default="Qwen/Qwen2.5-Omni-7B", show_default=True,
         help="vllm-omni backend: model path or name given to `vllm serve`."),
    _Opt("--health-timeout", type=float, callback=finite_seconds, default=1800.0, show_default=True,
         help="vllm-omni backend: seconds to wait for /health."),
    _Opt("--request-timeout", type=float, callback=finite_seconds, default=900.0, show_default=True,
         help="vllm-omni backend: seconds per request."),
    _Opt("--stall-timeout", type=float, callback=finite_seconds, default=0.0, show_default=True,
         help="vllm-omni backend, streamed answers: a stream that sends nothing for this many seconds after its "
              "first bytes fails its request as stalled (0: only --request-timeout ends it)."),
    _Opt("--stream", is_flag=True, help="vllm-omni backend: ask for the audio streamed (stream: true) and measure it "
         "as it arrives: time to the first audio bytes, every inter-chunk gap, underruns of a player started at the "
         "first chunk (docs/streaming.md). The records gain stream_* fields; the map's TTFA is then measured."),
    _Opt("--platform", "serve_platform", type=click.Choice(["auto", "gpu", "cpu"]), default="auto",
         show_default=True, per_command={"help": {
             "run": "vllm-omni backend: the server's platform profile (auto: gpu when this host has a GPU device "
                    "node).",
             "sweep": "vllm-omni backend: the server's platform profile."}}),
    _Opt("--trace", "trace", type=click.Choice(list(TRACE_LEVELS)), default=None, show_default=False,
         per_command={"help": {
             "run": "vllm-omni backend: what the Talker worker's trace plugin does on every talker_preprocess call "
                    "(default contract): 'contract' traces the spans and checks the contract's rows; 'spans' "
                    "traces without the check; 'off' runs the server untouched (no span facts: no events, no "
                    "misaligned counts, no codec stream; the gate refuses the rules that need them). Recorded per "
                    "cell in the manifest and named in the latency notes (docs/real-backend.md).",
             "sweep": "vllm-omni backend: the trace plugin's level (see `omni-stress run --help`; default contract)."}}),
    _Opt("--serve-python", type=click.Path(path_type=Path), default=None, per_command={"help": {
        "run": "vllm-omni backend: interpreter for arms whose arms.yaml entry has no serve: entry (default "
               "$OMNI_STRESS_SERVE_PYTHON, else ./.venv-omni/bin/python).",
        "sweep": "vllm-omni backend: interpreter for arms without a serve: entry."}}),
    _Opt("--arm-timeout", type=click.FloatRange(0, 86400), callback=finite_seconds, default=armcall.DEFAULT_LIMIT_S,
         show_default=True, per_command={"help": {
             "run": "sim: seconds one talker_preprocess call may take before it fails its request (0: no limit).",
             "sweep": "sim: seconds one talker_preprocess call may take (0: no limit)."}}),
    _Opt("--executor", "executor", type=click.Choice(list(EXECUTORS)), default="local", show_default=True,
         help="Where cells run: 'local' (this machine) or 'ray' (one Ray task per cell on a cluster; records, "
              "spans and audio come back here). Needs the ray extra: pip install omni-stress[ray]."),
    _Opt("--ray-address", "ray_address", default=None, metavar="ADDR", callback=_address,
         help="--executor ray: the cluster to use (HOST:PORT of the head's GCS, ray://HOST:PORT, or 'auto': "
              "the cluster `ray start` left on this machine; default $RAY_ADDRESS, else a one-machine Ray "
              "started for the run)."),
)


def shared_run_options(command: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options of ``command`` (``run`` or ``sweep``) from the shared table, in ``--help`` order."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for opt in reversed(_OPTIONS):  # Click lists options in the reverse of the order they are applied
            if opt.only in (None, command):
                func = opt.decorator(command)(func)
        return func

    return apply


def family_defaults(family: str | None, **values: Any) -> dict[str, Any]:
    """``values`` (``arms``, ``deploys``, ``prompt_set``) with the ones the user left at Click's default
    replaced by ``--family``'s own: ``--family X`` alone runs X's arms, deploys and prompts."""
    if family is None:
        return values
    from harness.family import get_family

    fam = get_family(family)
    own = {"arms": fam.default_arms, "deploys": fam.default_deploys, "prompt_set": fam.default_prompts}
    ctx = click.get_current_context(silent=True)
    for name in values:
        if ctx is not None and ctx.get_parameter_source(name) is click.core.ParameterSource.DEFAULT:
            values[name] = own[name]
    return values


@dataclass
class RunArgs:
    """The shared options of ``run`` and ``sweep``, typed once (``from_click``): the commands and the
    run-directory code read fields, never Click's positional values."""

    arms: tuple[str, ...]
    arms_file: Path | None
    prompt_set: str
    family: str | None
    repeat: int
    seed: int
    out: Path
    run_id: str | None
    resume_dir: Path | None
    backend: str
    sim_talker: str
    asr: str
    asr_model: str
    beam_size: int
    asr_workers: int | None
    asr_batch: int
    sim_workers: int | None
    cache_dir: Path | None
    no_cache: bool
    quiet: bool
    model: str
    health_timeout: float
    request_timeout: float
    serve_platform: str
    serve_python: Path | None
    arm_timeout: float
    executor: str
    ray_address: str | None
    trace: str | None = None  # --trace (None: not given; the real backend's default is contract)
    stream: bool = False
    stall_timeout: float = 0.0  # --stall-timeout (the real backend's streamed answers)
    deploys: tuple[str, ...] = ()  # run only (a sweep's deploys are its grid)
    dry_run: bool = False  # run only

    @classmethod
    def from_click(cls, values: dict[str, Any]) -> RunArgs:
        """Click's values as typed options, checked once as the command starts: ``--family``'s
        defaults, a safe ``--run-id``, every path made absolute (a plugin arm may os.chdir() when it
        is imported or called, and a relative --out must still mean what the user typed), and, for
        ``--executor ray``, a cluster that answers (before any run directory exists)."""
        from harness.rundir import absolute_paths, check_run_id

        names = {f.name for f in fields(cls)}
        args = cls(**{k: v for k, v in values.items() if k in names})
        picked = family_defaults(args.family, arms=args.arms, deploys=args.deploys, prompt_set=args.prompt_set)
        args.arms, args.deploys, args.prompt_set = picked["arms"], picked["deploys"], picked["prompt_set"]
        if args.run_id is not None:
            check_run_id(args.run_id)
        (args.out, args.resume_dir, args.cache_dir, args.arms_file, args.serve_python,
         args.asr_model) = absolute_paths(args.out, args.resume_dir, args.cache_dir, args.arms_file,
                                          args.serve_python, args.asr_model)
        if args.asr_batch and args.asr not in ("faster-whisper", "none"):
            from harness.errors import UserError

            raise UserError(f"--asr-batch {args.asr_batch}: the batched pipeline is faster-whisper's "
                            f"(--asr faster-whisper), not --asr {args.asr}")
        get_executor(args.executor).preflight(args.ray_address, dry_run=args.dry_run)
        return args

    def run_options(self, **extra: Any) -> Any:
        """The ``RunOptions`` every backend and executor reads (``harness.backends``)."""
        from harness.backends import RunOptions

        return RunOptions(backend=self.backend, repeat=self.repeat, seed=self.seed, asr=self.asr,
                          asr_model=self.asr_model, beam_size=self.beam_size, cache_dir=self.cache_dir,
                          use_cache=not self.no_cache, quiet=self.quiet,
                          asr_workers=-1 if self.asr_workers is None else self.asr_workers,
                          asr_batch=self.asr_batch,
                          sim_workers=-1 if self.sim_workers is None else self.sim_workers,
                          sim_talker=self.sim_talker, executor=self.executor, ray_address=self.ray_address,
                          stream=self.stream, **extra)
