"""The `moepack` command line: a lazy click group (so `--help` imports no numba), one module per command."""

from __future__ import annotations

import importlib
import sys

import click

from .. import __version__

# command name -> (module, attribute); modules are imported only when the command runs or shows help
COMMANDS = {
    "convert": ("moepack.cli.convert_cmd", "convert_cmd"),
    "demo": ("moepack.cli.demo_cmd", "demo_cmd"),
    "verify": ("moepack.cli.verify_cmd", "verify_cmd"),
    "verify-rmse": ("moepack.cli.verify_cmd", "verify_rmse_cmd"),
    "inspect": ("moepack.cli.verify_cmd", "inspect_cmd"),
    "eval": ("moepack.cli.eval_cmd", "eval_cmd"),
    "run": ("moepack.cli.run_cmd", "run_cmd"),
    "chat": ("moepack.cli.run_cmd", "chat_cmd"),
    "publish": ("moepack.cli.hub_cmd", "publish_cmd"),
    "pull": ("moepack.cli.hub_cmd", "pull_cmd"),
    "selftest": ("moepack.cli.selftest_cmd", "selftest_cmd"),
    "bench-io": ("moepack.cli.io_cmd", "bench_io_cmd"),
    "trace": ("moepack.cli.io_cmd", "trace_cmd"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        mod, attr = COMMANDS[name]
        return getattr(importlib.import_module(mod), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="moepack")
def cli():
    """moepack: run Mixture-of-Experts LLMs larger than RAM by streaming experts from SSD.

    \b
    Typical use:
      moepack convert mlx-community/Qwen3.5-397B-A17B-4bit ./qwen397-q2 --bits 2
      moepack verify ./qwen397-q2
      moepack verify-rmse ./qwen397-q2
      moepack inspect ./qwen397-q2
    """


def main(argv=None):
    from .errors import run_guarded

    return run_guarded(cli, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
