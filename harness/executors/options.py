"""``--executor`` and ``--ray-address``: where a command's cells run (``omni-stress run``, and any
command that runs cells). One decorator, so every such command spells the options the same way."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import click

from harness.errors import UserError
from harness.executors import EXECUTORS


def _address(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        raise click.BadParameter("an address (HOST:PORT, ray://HOST:PORT) or 'auto'", ctx, param)
    return value


def executor_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """Adds ``executor`` (``local`` or ``ray``, default ``local``) and ``ray_address`` (``None``:
    ``RAY_ADDRESS`` or a local cluster) parameters to a Click command. Before the command runs
    (so before any run directory exists), ``--executor ray`` checks that Ray is installed and that
    the cluster answers: one line and exit 2 otherwise."""

    command = func

    @functools.wraps(command)
    def checked(*args: Any, **kwargs: Any) -> Any:
        executor, address = kwargs.get("executor", "local"), kwargs.get("ray_address")
        if executor == "ray" and not kwargs.get("dry_run"):
            from harness.executors.ray import preflight

            preflight(address)
        elif executor != "ray" and address is not None:
            raise UserError(f"--ray-address {address}: applies to --executor ray")
        return command(*args, **kwargs)

    func = checked
    func = click.option(
        "--ray-address", "ray_address", default=None, metavar="ADDR", callback=_address,
        help="--executor ray: the cluster to use (HOST:PORT of the head's GCS, ray://HOST:PORT, or 'auto': "
             "the cluster `ray start` left on this machine; default $RAY_ADDRESS, else a one-machine Ray "
             "started for the run).")(func)
    func = click.option(
        "--executor", "executor", type=click.Choice(list(EXECUTORS)), default="local", show_default=True,
        help="Where cells run: 'local' (this machine) or 'ray' (one Ray task per cell on a cluster; records, "
             "spans and audio come back here). Needs the ray extra: pip install omni-stress[ray].")(func)
    return func
