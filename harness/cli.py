"""The ``omni-stress`` command group."""

from __future__ import annotations

import errno
import importlib
import pkgutil
import sys

import click

import harness.commands
from harness.errors import UserError


class _Group(click.Group):
    """Turns UserError, click's own usage errors (a bad option value, an unknown option) and a
    full disk into one line on stderr and exit code 2, with no traceback and no usage block."""

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"omni-stress: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" writing {exc.filename}" if exc.filename else ""
            click.echo(f"omni-stress: error: {(exc.strerror or 'no space left on device').lower()}{where}", err=True)
            sys.exit(2)
        except click.UsageError as exc:
            sub = exc.ctx.command_path.split()[1:] if exc.ctx is not None else []
            where = " ".join(["omni-stress", *sub])
            message = " ".join(exc.format_message().split())
            click.echo(f"omni-stress: error: {message} (see '{where} --help')", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="omni-stress")
def main() -> None:
    """Stress-test the Qwen2.5-Omni Talker and score its speech with Whisper."""


for _info in sorted(pkgutil.iter_modules(harness.commands.__path__), key=lambda m: m.name):
    _module = importlib.import_module(f"harness.commands.{_info.name}")
    main.add_command(_module.command)


if __name__ == "__main__":
    main()
