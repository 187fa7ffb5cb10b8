"""Model families: everything specific to one upstream stage model that reads the phase metadata.

Why a seam: the scheduler, the runner's copy rules, events, records, scoring, reports, the gate,
sweeps and executors are the same for every model whose stage runs under vLLM-Omni's runner; what
differs is the stage chain, the rows the hook must deliver (the contract), the sim's Talker rules,
the real server's request format and trace target, and the shipped arms, deploys and prompt sets.
A family package (``harness/families/<package>/``) holds those and exposes one ``FAMILY``; the rest
of the harness asks ``get_family(name)`` and never names a model.

The registry below maps a family's name (a deploy's ``family:``, ``--family``) to its package by
*name only*, so ``harness.config`` can validate a ``family:`` field without importing any family
(no import climbs from the low modules into the families).

Adding a family: a package here with ``__init__.py`` defining ``FAMILY`` (a ``Family``) and the
modules its hooks name, one line in ``FAMILY_PACKAGES``, and its YAML (deploys naming the family,
a prompt set, arms). README "Adding a model family" lists the files.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.errors import UserError

# family name -> package under harness.families, or a full dotted module path for a family kept
# elsewhere (imported only when the family is used)
FAMILY_PACKAGES: dict[str, str] = {
    "qwen2.5-omni": "qwen2_5_omni",
    "qwen3-tts": "qwen3_tts",
}
DEFAULT_FAMILY = "qwen2.5-omni"
# Families whose stage under test takes the user's text itself (no Thinker): their prompt sets give each
# prompt's ``text`` (what to say, the WER reference) instead of ``user`` + ``reply`` (harness.config).
TEXT_INPUT_FAMILIES = frozenset({"qwen3-tts"})


@dataclass(frozen=True)
class Family:
    """What the harness needs to know of one model family; hooks are ``module:attr`` strings,
    imported on first use so that naming a family costs nothing."""

    name: str  # the deploy's ``family:`` and ``--family``
    stages: tuple[str, ...]  # the stage chain, in order (the real server's stage ids are the indices)
    stage_under_test: int  # index in ``stages`` of the stage whose hook is traced and bound
    hook: str  # the method the runner calls with the phase metadata (``talker_preprocess``)
    trace_target: str  # ``module:Class`` of the installed vLLM-Omni whose ``hook`` the worker wraps
    request_api: str  # the real server's path the client posts prompts to
    conform_model: str  # the ``omni-stress conform`` adapter of this family's hook
    default_arms: tuple[str, ...]  # --arm when none is given (names in deploy_configs/arms.yaml)
    default_deploys: tuple[str, ...]  # --deploy when none is given
    default_prompts: str  # --prompts when none is given
    sim_talkers: tuple[str, ...]  # the sim's Talker modes for this family (--sim-talker); first = default
    sim_cell: str  # ``module:function`` building a sim cell (``harness.sim.cell.SimCell``)
    sim_check_prompts: str  # ``module:function(prompts, talker_mode)``: refuse prompts the sim would mis-score
    # the module of this family's speaking tiny model's rules (``decode``, ``CODEC_EOS``): ``fidelity`` reads both
    # runs' codec streams back with its ``decode``; None: the family has no speaking checkpoint
    speaking_rules: str | None = None
    # what that speaking Talker cannot hear, for the note under the seed table when its oracle is the WER (None:
    # Qwen2.5-Omni's, ``harness.report.tables.SPEAKING_BLIND_SPOTS``)
    speaking_blind_spots: str | None = None
    # ``module:function(arm) -> impl``: how an arm of this family is loaded (its hook's name, upstream files);
    # None: Qwen2.5-Omni's ``talker_preprocess`` arms (``harness.talkers``)
    load_arm: str | None = None
    # None: the real backend (``--backend vllm-omni``) drives this family; else why it does not, said to the user
    serve_missing: str | None = None
    # the real backend's family-specific module (``translate``, ``speech_body``, ``oracle``, ``server_env``):
    # None: Qwen2.5-Omni's chat path (``--stage-overrides``, ``/v1/chat/completions``)
    serve_module: str | None = None
    # the gate's default rules for a run of this family (``omni-stress gate`` without --rules; a name in
    # deploy_configs/): the seed's bounds are Qwen2.5-Omni's, another model's bug may show in other measures
    gate_rules: str = "gates"

    @property
    def stage(self) -> str:
        return self.stages[self.stage_under_test]

    def hook_fn(self, attr: str) -> Callable[..., Any]:
        """One of this family's hooks (``sim_cell``), imported."""
        module, _, name = getattr(self, attr).partition(":")
        return getattr(importlib.import_module(module), name)


def family_names() -> tuple[str, ...]:
    return tuple(FAMILY_PACKAGES)


def get_family(name: str, where: str = "--family") -> Family:
    """The family ``name``; an unknown name is one line naming ``where`` (a file and field, or an option)."""
    package = FAMILY_PACKAGES.get(name)
    if package is None:
        raise UserError(f"{where}: unknown model family {name!r} (known: {', '.join(FAMILY_PACKAGES)})")
    module = package if "." in package else f"harness.families.{package}"
    family = importlib.import_module(module).FAMILY
    assert family.name == name, (family.name, name)
    return family


def choose_family(option: str | None, deploys: list[Any], prompts: Any, arms: list[Any]) -> Family:
    """The run's family: ``--family`` if given, else the deploys' (the default family when none
    names one). Every deploy, the prompt set and every arm must belong to it: a deploy of one
    family with an arm of another would drive a hook with rows it was never written for. The
    first that does not is one line naming its file and field (or the arm). Arms given as
    ``--arm NAME=module:attr`` take the run's family (``harness.config.ArmSpec.family``)."""
    name = option
    if name is None:
        named = sorted({d.family for d in deploys})
        if len(named) > 1:
            first = next(d for d in deploys if d.family != deploys[0].family)
            raise UserError(f"{first.path}: family: {first.family!r}, but {deploys[0].path} is "
                            f"{deploys[0].family!r}; one run drives one model family (give --family to choose)")
        name = named[0] if named else DEFAULT_FAMILY
    family = get_family(name)
    why = f"the run's family is {family.name!r}" + (" (--family)" if option is not None else " (its deploys')")
    for d in deploys:
        if d.family != family.name:
            raise UserError(f"{d.path}: family: {d.family!r}, but {why}")
    if prompts is not None and prompts.family != family.name:
        raise UserError(f"{prompts.path}: family: {prompts.family!r}, but {why}; give a prompt set of "
                        f"{family.name} (e.g. --prompts {family.default_prompts})")
    for a in arms:  # a plugin or upstream arm given on the command line implements the run's family's hook
        if a.source != "--arm" and a.family != family.name:
            raise UserError(f"arm {a.name!r} ({a.source}): family {a.family!r}, but {why}")
    return family
