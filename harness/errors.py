"""Errors the CLI turns into one clear line and exit code 2."""


class UserError(Exception):
    """Bad input or a broken environment: the user can fix it, no traceback needed."""

    exit_code = 2


class ConfigError(UserError):
    """A config file, field or value is wrong; the message names it."""


class WorkerOutOfMemory(MemoryError):
    """A sim worker ran out of memory in ``cell`` (a MemoryError, or a library it had no memory to
    load); the run turns it into one line (``harness.rundir.out_of_memory_error``)."""

    def __init__(self, cell: str) -> None:
        super().__init__(cell)
        self.cell = cell


def out_of_memory(exc: BaseException) -> bool:
    """A ``MemoryError``, ``ENOMEM``, or an import that failed because no memory was left to map the
    library (``ImportError: ... failed to map segment from shared object`` under ``ulimit -v``)."""
    import errno

    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    text = str(exc)
    return isinstance(exc, ImportError) and ("failed to map segment" in text or "Cannot allocate memory" in text)


SHORT_REPR_CHARS = 200


def short_repr(value: object, limit: int = SHORT_REPR_CHARS) -> str:
    """``repr(value)`` for an error message, at most about ``limit`` characters, computed without
    building the whole repr: a YAML alias bomb of 509 bytes expands to a value whose full repr is
    hundreds of megabytes (issue 24, case 12)."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 3, 8, 8, 8, 8
    r.maxstring = r.maxother = r.maxlong = limit
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
