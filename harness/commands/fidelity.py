"""``omni-stress fidelity SIM_RUN REAL_RUN``: the sim beside a real run of the same work, with ratios.

Two runs of different model families are refused, one line, exit 2 (one family's codec streams mean nothing to the other's Talker).
Two sim runs (the same run twice included) or two real runs are refused, one line, exit 2: ratios of a
run against itself (1.00 everywhere) measure nothing about the sim's fidelity. ``--same-backend``
compares them anyway, as a self-check that the output labels as such (issue 33, case 4). An incomplete
run (killed, a torn last line) gets the warning ``report`` and ``compare`` give, or exit 2 with
``--strict`` (case 5)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click

from harness.proc import printable_streams


@click.command("fidelity")
@click.argument("sim_run", type=click.Path(path_type=Path))
@click.argument("real_run", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Also write the comparison to FILE as JSON.")
@click.option("--same-backend", is_flag=True,
              help="Compare two runs of the same backend (two sim runs, or two real runs) anyway: a self-check, "
                   "labelled as such, not a fidelity measurement.")
@click.option("--strict", is_flag=True, help="Exit 2 when a run is incomplete (killed, a torn last line), instead "
                                             "of a warning.")
def command(sim_run: Path, real_run: Path, json_path: Path | None, same_backend: bool, strict: bool) -> None:
    """Measure the sim against the real server: requests matched by arm, deploy, repeat and prompt; per arm x
    deploy and per request, oracle WER, codec tokens and scheduler events, sim beside real with the ratio."""
    printable_streams()
    from harness.report import fidelity, summary
    from harness.errors import UserError
    from harness.backends import is_simulated
    from harness.rundir import manifest_sim_talker, same_family
    from harness.records import write_file_atomic

    runs = [summary.load_run(sim_run), summary.load_run(real_run)]
    family = same_family(f"fidelity {sim_run} {real_run}", runs[0].manifest, runs[1].manifest,
                         "fidelity compares two runs of one model family")
    for run in runs:  # the check report and compare make, with the same warning (the gate refuses such a run)
        warning = summary.incomplete_warning(run, strict, "not compared (--strict)")
        if warning:
            click.echo(warning, err=True)
    backends = [run.manifest.get("backend") or "?" for run in runs]
    self_check = None
    if backends[0] == backends[1]:
        kind = "sim runs" if is_simulated(backends[0]) else "real runs"
        same = "the same run twice" if sim_run.resolve() == real_run.resolve() else f"both {kind}"
        if not same_backend:
            raise UserError(f"fidelity {sim_run} {real_run}: {same} (backend {backends[0]}); fidelity measures a "
                            f"sim run against a real run (--backend vllm-omni) of the same work: give one of each, "
                            f"or --same-backend for a self-check")
        self_check = f"self-check, not a fidelity measurement: {same} (backend {backends[0]}, --same-backend)"
    elif not is_simulated(backends[0]) and is_simulated(backends[1]) and not same_backend:
        raise UserError(f"fidelity {sim_run} {real_run}: the first run is the real one (backend {backends[0]}) and "
                        f"the second the sim run: give the sim run first (fidelity SIM_RUN REAL_RUN)")

    def side(run: summary.Run) -> fidelity.Side:
        return fidelity.Side(label=run.run_id, backend=run.manifest.get("backend"),
                             talker=manifest_sim_talker(run.manifest), records=run.requests,
                             events=summary.request_events(run),
                             schedules=fidelity.span_schedules(run.spans.raw),
                             overlap=fidelity.talker_overlap(run.spans.raw))

    result = fidelity.compare(side(runs[0]), side(runs[1]), _decoder(family, [manifest_sim_talker(r.manifest) for r in runs]))
    data = fidelity.as_json(result)
    text = fidelity.render_text(result)
    if self_check is not None:
        data = {"self_check": self_check, **data}
        text = f"{self_check}\n{text}"
    if json_path is not None:
        try:
            write_file_atomic(json_path, json.dumps(data, indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"--json {json_path}: cannot write ({exc.strerror or exc})") from None
    click.echo(text, nl=False)


def _decoder(family_name: str, talkers: list[str | None]) -> Callable[[list[int]], str] | None:
    """The family's speaking read-back (codes -> transcript) when both sides ran a speaking Talker (the real
    server's speaking checkpoint, or the sim's ``speaking`` mode); None otherwise (a words sim's codes are
    not the speaking table's)."""
    from harness.family import get_family

    if any(t not in (None, "speaking") for t in talkers):
        return None
    decode = get_family(family_name).speaking_rules().decode
    return lambda codes: decode(codes).text
