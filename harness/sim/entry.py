"""The sim's entry in the backend registry (``harness.backends.BACKENDS``): its hooks, light to
import (each imports what it needs when called), so naming the backend costs nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

SIM_CELL_TIMEOUT_S = 3600.0  # a sim cell that has not come back in an hour is lost (Ray executor)


class SimEntry:
    name = "sim"
    simulated = True  # cells are simulated: --sim-talker applies, the manifest records the Talker mode
    hashes_arm_code = True  # the manifest holds the arm's code hash, so --resume refuses an edited arm

    @staticmethod
    def make(run_dir: Path, options: Any) -> Any:
        from harness.sim.backend import SimBackend

        return SimBackend(run_dir, options)

    @staticmethod
    def prepare(args: Any, options: Any, prompts: Any) -> None:
        """Nothing to add to the run's options (the real backend adds its server options here); ``--trace``
        is refused (the sim computes spans and the contract itself, there is no plugin to turn down), and
        so is ``--stream`` (nothing streams in the sim)."""
        from harness.errors import UserError

        if getattr(args, "trace", None) is not None:
            raise UserError(f"--trace {args.trace} applies to --backend vllm-omni (the trace plugin in the real "
                            "Talker worker); the sim records its spans and contract itself, at no cost to what it "
                            "measures")
        if getattr(args, "stream", False):
            raise UserError("--stream: streamed audio is measured on the real server (--backend vllm-omni), not on "
                            "--backend sim (the sim's TTFA is in steps: omni-stress sweep)")

    @staticmethod
    def dry_run(arm_specs: list, deploy_specs: list, run_dir: Path, options: Any) -> str:
        from harness.errors import UserError

        raise UserError("--dry-run applies to --backend vllm-omni (the sim has no commands to print)")

    @staticmethod
    def preflight(arm_specs: list, deploy_specs: list, options: Any, prompts: Any = None) -> None:
        """A broken plugin arm, scheduler settings vLLM refuses, a reply the sim would mis-score (the
        prompt set's family says which: ``Family.check_prompts``), a text longer than a deploy holds."""
        from harness.sim.scheduler import resolve_talker, scheduler_config_for
        from harness.talkers import load_impl

        from harness.errors import UserError

        for arm in arm_specs:
            if arm.chunker:
                raise UserError(f"arm '{arm.name}': chunker {arm.chunker} runs in the real server's Talker worker "
                                "(--backend vllm-omni); the sim models the release's connector windows")
            load_impl(arm)
        for deploy in deploy_specs:
            scheduler_config_for(deploy)
        if prompts is not None:
            from harness.config import text_fits
            from harness.family import get_family

            family = get_family(prompts.family)
            family.check_prompts(prompts, options.sim_talker)
            if family.text_input:  # no Thinker cap: each text must fit each deploy's max_model_len
                lens = family.talker_prompt_lens(prompts)
                for deploy in deploy_specs:
                    text_fits(prompts, lens, deploy, resolve_talker(deploy).max_model_len)

    # ------------------------------------------------------------------ Ray (harness.executors.ray)
    @staticmethod
    def ray_resources(options: Any) -> dict[str, float]:
        return {"num_cpus": 1}

    @staticmethod
    def ray_cell_timeout(job: Any, options: Any) -> float:
        return SIM_CELL_TIMEOUT_S

    @staticmethod
    def ray_payload() -> Any:
        """What a Ray task needs besides the cell: the per-call arm limit of this process."""
        from harness.sim import armcall

        return armcall.limit()

    @staticmethod
    def ray_worker_setup(payload: Any) -> None:
        from harness.sim import armcall

        armcall.set_limit(payload)
