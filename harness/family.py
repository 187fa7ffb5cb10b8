"""The model-family contract and its registry.

Why a seam: the scheduler, the runner's copy rules, events, records, scoring, reports, the gate,
sweeps and executors are the same for every model whose stage runs under vLLM-Omni's runner; what
differs is the stage chain, the rows the hook must deliver (the contract), the sim's Talker rules,
the real server's request format and trace target, and the shipped arms, deploys and prompt sets.
A family is one package ``harness/families/<package>/`` whose ``__init__.py`` defines ``FAMILY``, an
instance of a subclass of ``Family`` below; the rest of the harness asks ``get_family(name)`` and never
names a model.

Every member of ``Family`` is required and has no default: a family that leaves one out would
otherwise borrow another model's rules without a word, so registration refuses it with one line naming
what is missing. The registry finds the packages itself (every package under ``harness.families``):
adding a family is its package and its YAML, nothing else (docs/adding-a-family.md).

This module is low (it imports only ``harness.errors``) so that ``harness.config`` can check a
``family:`` field; a family package imports its heavy modules inside its methods, so naming a family
costs one small import.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Any

from harness.errors import UserError

DEFAULT_FAMILY = "qwen2.5-omni"  # deploys, prompt sets and arms without a ``family:`` key
FAMILIES_PACKAGE = "harness.families"


class Family:
    """What the harness needs to know of one model family. Subclass it, set every attribute and
    define every method; ``FAMILY = MyFamily()`` in the package's ``__init__.py``."""

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
    # True: the stage under test takes the user's text itself (no Thinker), so the prompt sets give each
    # prompt's ``text`` (what to say, the WER reference) instead of ``user`` + ``reply`` (harness.config)
    text_input: bool
    # what the speaking Talker cannot hear, for the note under the summary table when its oracle is the WER
    speaking_blind_spots: str
    # the gate's default rules for a run of this family (``omni-stress gate`` without --rules; a name in
    # deploy_configs/): another model's bug may show in other measures
    gate_rules: str
    # None: the real backend (``--backend vllm-omni``) drives this family; else why it does not, said to the user
    serve_missing: str | None
    # the voices a prompt set's ``speaker:`` may name (the release's names); () : this family's prompts take none
    speakers: tuple[str, ...] = ()
    # True: a prompt set may give a Base voice as a speaker embedding (``speaker_embedding:``, the x-vector the
    # release's Base checkpoint takes in place of a CustomVoice speaker); False: this family's prompts take none
    speaker_embeddings: bool = False
    # the checkpoints ``tiny-model --variant NAME`` builds besides the family's default one (its builder's ``--NAME``)
    tiny_variants: tuple[str, ...] = ()

    def sim_cell(self, impl: Any, deploy: Any, prompts: Any, seed: int, talker_mode: str) -> Any:
        """One sim cell (``harness.sim.cell.SimCell``) for arm implementation ``impl``, a ``harness.config.Deploy``
        and ``PromptSet``."""
        raise NotImplementedError

    def check_prompts(self, prompts: Any, talker_mode: str) -> None:
        """Refuse (``UserError``) prompts the sim would mis-score in ``talker_mode``."""
        raise NotImplementedError

    def talker_prompt_lens(self, prompts: Any) -> list[int]:
        """The Talker prompt length ``P`` of each prompt of ``prompts`` (a ``harness.config.PromptSet``), as the
        sim's runner schedules it (``omni-stress list prompts``); pure and cheap: no sim, no torch."""
        raise NotImplementedError

    def load_arm(self, arm: Any) -> Any:
        """The implementation of ``arm`` (a ``harness.config.ArmSpec``): a class or function the sim binds
        and the worker installs."""
        raise NotImplementedError

    def speaking_rules(self) -> ModuleType:
        """The speaking tiny model's rules (``decode``, ``CODEC_EOS``): ``fidelity`` reads codec streams
        back with them."""
        raise NotImplementedError

    def serve(self) -> ModuleType:
        """The real backend's family module: ``translate(deploy, platform, speaking)``,
        ``request_body(model, prompts, prompt, deploy, tag, speaking, stream)``, ``oracle(codes)``,
        ``server_env()`` and ``BY_TEXT`` (True: the trace names a request by its text, not a chat tag)."""
        raise NotImplementedError

    def tiny_model_argv(self, out: str, seed: int, speaking: bool | None) -> list[str]:
        """The arguments after the real environment's interpreter that build this family's tiny
        checkpoint in ``out`` (``python -m ...``: the builder needs that environment's transformers);
        ``speaking``: ``--speaking`` (True), ``--random`` (False) or neither (None: the family's default)."""
        raise NotImplementedError

    @property
    def stage(self) -> str:
        return self.stages[self.stage_under_test]


REQUIRED_ATTRIBUTES = tuple(Family.__annotations__)
REQUIRED_METHODS = tuple(n for n, v in vars(Family).items() if callable(v) and not n.startswith("_"))


def check_family(family: Any, where: str) -> Family:
    """``family`` if it is a complete ``Family``; else one line naming ``where`` and every member it lacks."""
    if not isinstance(family, Family):
        raise UserError(f"{where}: FAMILY is {type(family).__name__}, not a harness.family.Family")
    missing = [n for n in REQUIRED_ATTRIBUTES if not hasattr(family, n)]
    missing += [n for n in REQUIRED_METHODS if getattr(type(family), n) is getattr(Family, n)]
    if missing:
        raise UserError(f"{where}: family {getattr(family, 'name', '?')!r} does not declare "
                        f"{', '.join(missing)} (every member of harness.family.Family is required)")
    return family


# Modules outside harness.families that define a ``FAMILY`` (a test's toy family, a user's own package):
# ``register(module)`` adds one.
EXTRA_MODULES: list[str] = []
_CACHE: dict[tuple[str, ...], dict[str, Family]] = {}


def _family_modules() -> list[str]:
    package = importlib.import_module(FAMILIES_PACKAGE)
    found = sorted(m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg)
    return [f"{FAMILIES_PACKAGE}.{name}" for name in found] + EXTRA_MODULES


def registry() -> dict[str, Family]:
    """Every family by name, in package order; each checked once."""
    modules = tuple(_family_modules())
    if modules not in _CACHE:
        families: dict[str, Family] = {}
        for module in modules:
            family = check_family(getattr(importlib.import_module(module), "FAMILY", None), module)
            if family.name in families:
                raise UserError(f"{module}: family name {family.name!r} is taken by another package")
            families[family.name] = family
        _CACHE[modules] = families
    return _CACHE[modules]


def register(module: str) -> None:
    """Add a family kept outside ``harness.families`` (its module defines ``FAMILY``)."""
    if module not in EXTRA_MODULES:
        EXTRA_MODULES.append(module)


def family_names() -> tuple[str, ...]:
    return tuple(registry())


def get_family(name: str, where: str = "--family") -> Family:
    """The family ``name``; an unknown name is one line naming ``where`` (a file and field, or an option)."""
    families = registry()
    if name not in families:
        raise UserError(f"{where}: unknown model family {name!r} (known: {', '.join(families)})")
    return families[name]


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
