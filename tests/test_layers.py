"""Arrows run one way (issue 29): the low modules (records, config, metrics, the contract's events,
physics, speech units, the family registry) import nothing above them, not even lazily; audio does
not import the sim; a backend never imports the pipeline or a command."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

LOW = {"harness/records.py", "harness/config.py", "harness/metrics.py", "harness/physics.py",
       "harness/speech_units.py", "harness/contract.py", "harness/errors.py",
       "harness/family.py",  # the family contract and registry (issue 46): finds the packages, imports none
       "harness/moved.py",  # old module paths of moved arms
       "harness/tokenizer.py", "harness/spanstore.py",  # spanstore: the span half of the records (issue 48)
       "harness/roles.py"}  # roles: what a deploy is for (issue 46), read by config and the report
LOW_MODULES = {p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in LOW}
_IMPORT = re.compile(r"^\s*(?:from|import) (harness[\w.]*)")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if (m := _IMPORT.match(line)) is not None:
            out.append((i, m.group(1)))
    return out


def test_low_modules_import_only_low_modules():
    found = [f"{rel}:{i}: {mod}" for rel in sorted(LOW) for i, mod in _imports(REPO / rel)
             if mod not in LOW_MODULES]
    assert found == []


def test_audio_does_not_import_the_sim_and_backends_do_not_import_the_pipeline():
    found = []
    for folder, banned in (("harness/audio", ("harness.sim",)),
                           ("harness/sim", ("harness.pipeline", "harness.commands")),
                           ("harness/serve", ("harness.pipeline", "harness.commands"))):
        for path in sorted((REPO / folder).rglob("*.py")):
            for i, mod in _imports(path):
                if mod.startswith(banned):
                    found.append(f"{path.relative_to(REPO)}:{i}: {mod}")
    assert found == []
