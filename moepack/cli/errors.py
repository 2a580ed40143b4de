"""One place that turns exceptions into one-line messages with the next step (no tracebacks)."""

from __future__ import annotations

import errno
import sys

import click

from ..errors import MoepackError


def _fail(message: str, hint: str | None, code: int) -> int:
    click.echo(f"error: {message}", err=True)
    if hint:
        click.echo(f"hint: {hint}", err=True)
    return code


def run_guarded(cli, argv=None) -> int:
    try:
        # with standalone_mode=False click returns ctx.exit()'s code instead of raising
        rv = cli.main(args=argv, prog_name="moepack", standalone_mode=False)
        return rv if isinstance(rv, int) else 0
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):  # click turns Ctrl-C into Abort
        return _fail("interrupted", "re-run the same command to resume where it stopped", 130)
    except MoepackError as e:
        return _fail(e.message, e.hint, e.exit_code)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return _fail(f"disk full ({e.filename or ''})", "free some disk space, then re-run to resume", 1)
        where = f" ({e.filename})" if e.filename else ""
        return _fail(f"{e.strerror or e}{where}", "check the path and its permissions", 1)
    except BrokenPipeError:  # pragma: no cover
        sys.stderr.close()
        return 1
