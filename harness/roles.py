"""What a deploy is for: a ``reference`` deploy is what a ``stress`` deploy is measured against.

A deploy declares ``role:`` and, when it is a stress deploy, ``pair:`` (the reference deploy it is
compared with); the run's manifest records both (``deploy_roles``), and the paired table, its audio
players and the gate's ``reference_deploy: pair`` read them, for every model family. Pure: the config
loader and the report both import it.
"""

from __future__ import annotations

DEPLOY_ROLES = ("reference", "stress")


def deploy_role(name: str, role: str | None = None, pair: str | None = None) -> tuple[str, str | None]:
    """(role, pair) of a deploy named ``name`` that declares ``role`` and ``pair`` (None: not declared).

    Undeclared, as every deploy was before roles (and every run recorded then): ``reference`` and
    ``*-reference`` are references, anything else is a stress deploy paired with the reference of its
    name's prefix (``cpu-stress`` with ``cpu-reference``, ``stress`` and ``specdec`` with ``reference``).
    A reference has no pair."""
    if role is None:
        role = "reference" if name == "reference" or name.endswith("-reference") else "stress"
    if role == "reference":
        return role, None
    if pair is None:
        pair = f"{name.rsplit('-', 1)[0]}-reference" if "-" in name else "reference"
    return role, pair
