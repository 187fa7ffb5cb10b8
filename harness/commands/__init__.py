"""CLI subcommands: each module defines ``command`` (a click.Command); cli.py adds them all."""
