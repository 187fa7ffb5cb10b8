"""The ``omni-stress`` command group.

Each command lives in ``harness/commands/<module>.py`` (a ``command`` made by ``@click.command``)
and is imported only when it runs, so ``--help``, ``report``, ``gate``, ``compare`` and ``list``
start without torch, vLLM, Whisper or matplotlib (tests/test_lazy_imports.py). ``--help`` and
the command names come from the modules' source, read with ``ast``: the ``@click.command("NAME")``
decorator and the function's docstring, the text click itself would show, with nothing to keep
in step by hand.
"""

from __future__ import annotations

import ast
import atexit
import errno
import importlib
import os
import pkgutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import click

import harness.commands
from harness import interrupt
from harness.errors import UserError


@dataclass(frozen=True)
class _Listed:
    """A command as ``--help`` lists it, before its module is imported."""

    module: str  # in harness.commands
    help: str | None
    short_help: str | None = None
    hidden: bool = False


def _read_command(path: Path) -> tuple[str, _Listed] | None:
    """NAME and help of the ``command`` that ``@click.command(...)`` makes in PATH; None when the
    source does not say them plainly (the module is then imported to ask)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError, SyntaxError):
        return None
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name == "command"):
            continue
        for deco in node.decorator_list:
            if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute) and deco.func.attr == "command"
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "click"):
                try:
                    kw = {k.arg: ast.literal_eval(k.value) for k in deco.keywords}
                    name = ast.literal_eval(deco.args[0]) if deco.args else kw.get("name")
                except ValueError:
                    return None
                if not isinstance(name, str) or set(kw) - {"name", "help", "short_help", "hidden"}:
                    return None
                return name, _Listed(path.stem, kw.get("help") or ast.get_docstring(node, clean=False),
                                     kw.get("short_help"), bool(kw.get("hidden", False)))
    return None


class _Group(click.Group):
    """Turns UserError, click's own usage errors (a bad option value, an unknown option) and a
    full disk into one line on stderr and exit code 2, with no traceback and no usage block.

    Commands load lazily: ``get_command`` imports ``harness.commands.<module>`` the first time the
    command is asked for; ``--help`` lists them from their source without importing any."""

    _listed: dict[str, _Listed] | None = None

    def listed(self) -> dict[str, _Listed]:
        """Every command in harness/commands, by name (a module whose source is unclear is imported)."""
        if self._listed is None:
            listed: dict[str, _Listed] = {}
            for info in pkgutil.iter_modules(harness.commands.__path__):
                found = _read_command(Path(info.module_finder.path) / f"{info.name}.py")  # type: ignore[union-attr]
                if found is None:
                    cmd = importlib.import_module(f"harness.commands.{info.name}").command
                    self.add_command(cmd)
                    found = cmd.name, _Listed(info.name, cmd.help, cmd.short_help, cmd.hidden)
                listed[found[0]] = found[1]
            self._listed = listed
        return self._listed

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.listed(), *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.listed():
            module = importlib.import_module(f"harness.commands.{self.listed()[cmd_name].module}")
            self.add_command(module.command, cmd_name)
        return self.commands.get(cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's own listing, with a stand-in for each command not imported yet."""
        commands = []
        for name in self.list_commands(ctx):
            cmd = self.commands.get(name)
            if cmd is None:
                entry = self.listed()[name]
                cmd = click.Command(name, help=entry.help, short_help=entry.short_help, hidden=entry.hidden)
            if not cmd.hidden:
                commands.append((name, cmd))
        if commands:
            limit = formatter.width - 6 - max(len(name) for name, _ in commands)
            with formatter.section("Commands"):
                formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in commands])

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
        except KeyboardInterrupt:  # a Ctrl-C: one line saying what is on disk, exit 130 (not click's "Aborted!")
            click.echo(f"\nomni-stress: {interrupt.message()}", err=True)
            sys.exit(interrupt.EXIT_INTERRUPTED)
        except click.UsageError as exc:
            sub = exc.ctx.command_path.split()[1:] if exc.ctx is not None else []
            where = " ".join(["omni-stress", *sub])
            message = " ".join(exc.format_message().split())
            click.echo(f"omni-stress: error: {message} (see '{where} --help')", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="omni-stress")
def main() -> None:
    """Stress-test a speech model's Talker under the scheduler's chunking, replays and preemption
    (Qwen2.5-Omni, Qwen3-TTS; the embedded sim or a real vLLM-Omni server), score its speech with
    Whisper and gate the result."""
    from harness.cachedirs import redirect_unwritable

    redirect_unwritable(click.get_current_context().invoked_subcommand)  # before a library writes its cache


def exit_status(code: object) -> int:
    """What ``sys.exit(code)`` would end the process with (``None`` 0, an int itself, else printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def entry() -> None:
    """The console script: the command group, then an exit without the interpreter's teardown.

    Why: a command that imported torch and vLLM (``run``, ``sweep``, ``fidelity`` ...) spends about
    2 s of one core in CPython's finalisation (module teardown and its last garbage collection over
    those graphs) after every file is written and the tables are printed: 13 % of a warm
    ``omni-stress run`` (issue 34). Once the command has returned, the ``atexit`` handlers run as
    usual (logging, temporary folders, multiprocessing's), the standard streams are flushed, and the
    process ends with the command's exit status. A process with another thread or a child process
    still alive (Ray's driver, a pool shutting down) exits the ordinary way, and so does one whose
    ``OMNI_STRESS_FULL_EXIT`` is ``1`` (a profiler or coverage that wants the teardown).

    Every SIGINT ends the command with exit 130 (``harness.interrupt``): one whose
    ``KeyboardInterrupt`` was swallowed on the way, or that arrived after the last record, still says
    so here."""
    interrupt.install()
    try:
        main()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    status = exit_status(code)
    if interrupt.finish() and status != interrupt.EXIT_INTERRUPTED:
        click.echo(f"omni-stress: {interrupt.message()}", err=True)
        status = interrupt.EXIT_INTERRUPTED
    mp = sys.modules.get("multiprocessing")
    if (os.environ.get("OMNI_STRESS_FULL_EXIT") == "1" or threading.active_count() > 1
            or (mp is not None and mp.active_children())):
        interrupt.release()  # a teardown that waits on a thread can still be stopped with Ctrl-C
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - as CPython: a stdout that cannot be flushed at exit is status 120
            status = status or 120
    os._exit(status)


if __name__ == "__main__":
    entry()
