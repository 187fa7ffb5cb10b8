"""The real backend's entry in the backend registry (``harness.backends.BACKENDS``): its hooks and
typed options, light to import (each imports what it needs when called)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

GPUS_PER_REAL_CELL = 2  # a real Qwen2.5-Omni cell on GPUs: Thinker and Talker/Code2Wav (Ray executor)


class ServeEntry:
    name = "vllm-omni"
    simulated = False  # a real `vllm serve --omni`: its own Talker (no --sim-talker)
    hashes_arm_code = False  # the arm's code runs in the server's environment, hashed there

    @staticmethod
    def options(args: Any) -> Any:
        """The backend's typed options (``ServeOptions``) from the run's (``harness.cli_options.RunArgs``)."""
        from harness.serve.backend import ServeOptions

        return ServeOptions(model=args.model, health_timeout_s=args.health_timeout,
                            request_timeout_s=args.request_timeout, platform=args.serve_platform,
                            stall_timeout_s=getattr(args, "stall_timeout", 0.0) or 0.0,
                            default_python=str(args.serve_python) if args.serve_python else None,
                            trace_level=args.trace or "contract",
                            stream=bool(getattr(args, "stream", False)))

    @classmethod
    def prepare(cls, args: Any, options: Any, prompts: Any) -> None:
        """The server's options into the run's; prompts the real server cannot send are refused."""
        from harness.errors import UserError

        if prompts is not None:
            with_audio = [p.id for p in prompts.prompts if p.audio_seconds]
            if with_audio:
                raise UserError(f"{prompts.path}: prompt {with_audio[0]!r}: audio_seconds inputs are simulated only; "
                                "the vllm-omni backend sends text prompts")
        options.serve = cls.options(args)

    @staticmethod
    def make(run_dir: Path, options: Any) -> Any:
        from harness.serve.backend import ServeBackend

        return ServeBackend(run_dir, options.serve)

    @staticmethod
    def dry_run(arm_specs: list, deploy_specs: list, run_dir: Path, options: Any) -> str:
        from harness.serve.backend import describe_cell

        check_deploys(deploy_specs)
        return "\n".join(describe_cell(a, d, run_dir, options.serve) for a in arm_specs for d in deploy_specs)

    @staticmethod
    def preflight(arm_specs: list, deploy_specs: list, options: Any, prompts: Any = None) -> None:
        """A family or runner this backend does not drive; an arm whose server cannot be started (no
        interpreter, no vLLM-Omni there); a streamed run holding more streams than the client's
        measured ceiling (``harness.serve.capacity``)."""
        from harness.serve.backend import preflight_arm

        check_deploys(deploy_specs)
        if prompts is not None:
            check_speech_texts(deploy_specs, prompts)
            check_model_voices(deploy_specs, prompts, options.serve.model)
            if options.serve.stream:  # more streams than the client stamps faithfully (docs/streaming.md)
                from harness.serve.capacity import check_streams

                check_streams(deploy_specs, len(prompts.prompts))
        for arm in arm_specs:
            preflight_arm(arm, options.serve)

    # ------------------------------------------------------------------ Ray (harness.executors.ray)
    @staticmethod
    def ray_resources(options: Any) -> dict[str, float]:
        """A CPU server needs a CPU; a GPU one the deploy's GPUs."""
        if getattr(options.serve, "platform", "auto") == "cpu":
            return {"num_cpus": 1}
        return {"num_cpus": 1, "num_gpus": GPUS_PER_REAL_CELL}

    @staticmethod
    def ray_cell_timeout(job: Any, options: Any) -> float:
        serve = options.serve
        health = getattr(serve, "health_timeout_s", 1800.0) or 1800.0
        request = getattr(serve, "request_timeout_s", 900.0) or 900.0
        return health + request * max(1, len(job.prompts.prompts)) + 600.0

    @staticmethod
    def ray_payload() -> Any:
        return None

    @staticmethod
    def ray_worker_setup(payload: Any) -> None:
        """Nothing: the server's own limits travel in ``options.serve``."""


def check_deploys(deploy_specs: list) -> None:
    """One line, exit 2, for a deploy the real server cannot run here: a family it does not drive yet
    (``Family.serve_missing``), or MRV2 (``talker.model_runner: v2``: vLLM-Omni runs MRV2 on CUDA only,
    and the real backend on this machine is the CPU platform's V1 runner)."""
    from harness.errors import UserError
    from harness.family import get_family

    for d in deploy_specs:
        family = get_family(d.family, f"{d.path}: family")
        if family.serve_missing:
            raise UserError(f"{d.path}: family {family.name}: {family.serve_missing}")
        if d.talker.model_runner != "v1":
            raise UserError(f"{d.path}: talker.model_runner: {d.talker.model_runner}: MRV2 runs on CUDA only; the "
                            "vllm-omni backend's CPU platform runs the V1 runner (run MRV2 deploys on --backend sim)")


def check_model_voices(deploy_specs: list, prompts: Any, model: str | None) -> None:
    """One line, exit 2, for prompts whose voices the served checkpoint cannot take (a family's
    ``check_model_voices``: Qwen3-TTS's CustomVoice speakers on a Base checkpoint, speaker embeddings on a
    CustomVoice one or of another size than its Talker's), before any server starts."""
    from harness.errors import UserError
    from harness.family import get_family

    if not model:
        return
    for family in dict.fromkeys(d.family for d in deploy_specs):
        check = getattr(get_family(family).serve(), "check_model_voices", None)
        if check is not None and (problem := check(model, prompts)):
            raise UserError(problem)


def check_speech_texts(deploy_specs: list, prompts: Any) -> None:
    """One line, exit 2, for two prompts with the same text in a family served through the speech API:
    its server names requests itself, so the trace's lines are filed by their text (``tts_text``) and two
    prompts saying the same text could not be told apart."""
    from harness.errors import UserError
    from harness.family import get_family

    if not any(get_family(d.family).serve().BY_TEXT for d in deploy_specs):
        return
    seen: dict[str, str] = {}
    for i, p in enumerate(prompts.prompts):
        if p.reply in seen:
            raise UserError(f"{prompts.path}: prompts[{i}].text: the same text as prompt {seen[p.reply]!r} (prompt "
                            f"{p.id!r}); the vllm-omni backend files a speech request's spans by its text, so each "
                            "prompt's text must differ")
        seen[p.reply] = p.id
