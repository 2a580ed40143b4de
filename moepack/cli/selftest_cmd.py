"""`moepack selftest`: compile every Metal kernel on this machine's executor and check it against numpy."""

from __future__ import annotations

import json
import sys

import click

_EXECUTORS = ("auto", "metal", "cuda", "metal-emu")


def _auto() -> str:
    if sys.platform == "darwin":
        from ..runtime.metal.executor_metal import available

        if available()[0]:
            return "metal"
    try:
        from ..runtime.metal.executor_cuda import available as cuda_available

        if cuda_available()[0]:
            return "cuda"
    except ImportError:
        pass
    return "metal-emu"


@click.command("selftest")
@click.option("--backend", type=click.Choice(_EXECUTORS), default="auto", show_default=True,
              help="Which executor runs the kernels: metal (Apple GPU), cuda (NVIDIA, via PTX), metal-emu (CPU "
                   "emulator, needs clang-19); auto: the first of those this machine has.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random test inputs.")
@click.option("--plan", "plan_of", type=click.Path(file_okay=False), default=None, metavar="PACKED",
              help="Instead: print the launch plan of PACKED's decode step (every dispatch checked against the "
                   "kernel signatures, none executed).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def selftest_cmd(backend, seed, plan_of, as_json):
    """Compile every kernel in metal/*.metal and check each against the numpy reference.

    \b
    On a Mac this shows that Apple's Metal compiler accepts the kernels and that they compute what the
    reference computes; paste the report into an issue. Exit status 1 when any case fails.

    \b
    Examples:
      moepack selftest                      # Apple GPU on a Mac, else CUDA, else the emulator
      moepack selftest --backend metal-emu  # the same kernels on the CPU (clang-19)
      moepack selftest --json > selftest.json
      moepack selftest --plan ./q397-2bit    # kernels, buffers, grids per layer and command buffer
    """
    if plan_of is not None:
        from ..runtime.metal.plan import format_plan, launch_plan

        plan = launch_plan(plan_of)
        click.echo(json.dumps(plan, indent=1) if as_json else format_plan(plan))
        return
    from ..runtime.metal.executors import make_executor
    from ..runtime.metal.selftest import environment, report, run_selftest

    name = _auto() if backend == "auto" else backend
    executor = make_executor(name)
    results = run_selftest(executor, seed=seed)
    rep = report(environment(executor), results)
    if as_json:
        click.echo(json.dumps(rep, indent=2))
    else:
        env = rep["environment"]
        click.echo(f"moepack {env['moepack']} selftest on {env['executor']}"
                   + (f" ({env['device']})" if env.get("device") else "") + f", {env['platform']}")
        extra = {k: v for k, v in env.items()
                 if k not in ("moepack", "executor", "device", "platform", "python", "machine")}
        if extra:  # what the executor reports of the machine (on a Mac: unified memory, no-copy buffers, ...)
            click.echo("  " + ", ".join(f"{k} {v}" for k, v in extra.items()))
        click.echo(f"{'case':<22}{'shapes':<26}{'max rel err':>12}{'tol':>9}{'s':>7}  result")
        for r in results:
            err = "-" if r.max_rel_err is None else f"{r.max_rel_err:.2e}"
            click.echo(f"{r.op:<22}{r.shapes:<26}{err:>12}{r.tolerance:>9.0e}{r.seconds:>7.2f}  "
                       + ("ok" if r.ok else "FAIL" + (f": {r.error}" if r.error else "")))
        click.echo(f"{rep['passed']} passed, {rep['failed']} failed")
    sys.exit(0 if rep["failed"] == 0 else 1)
