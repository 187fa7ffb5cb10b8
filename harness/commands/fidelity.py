"""``omni-stress fidelity SIM_RUN REAL_RUN``: the sim beside a real run of the same work, with ratios."""

from __future__ import annotations

import json
from pathlib import Path

import click

from harness.proc import printable_streams


@click.command("fidelity")
@click.argument("sim_run", type=click.Path(path_type=Path))
@click.argument("real_run", type=click.Path(path_type=Path))
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None,
              help="Also write the comparison to FILE as JSON.")
def command(sim_run: Path, real_run: Path, json_path: Path | None) -> None:
    """Measure the sim against the real server: requests matched by arm, deploy, repeat and prompt; per arm x
    deploy and per request, oracle WER, codec tokens and scheduler events, sim beside real with the ratio."""
    printable_streams()
    from harness import fidelity, summary
    from harness.errors import UserError
    from harness.pipeline import manifest_sim_talker
    from harness.records import write_file_atomic

    def side(path: Path) -> fidelity.Side:
        run = summary.load_run(path)
        return fidelity.Side(label=run.run_id, backend=run.manifest.get("backend"),
                             talker=manifest_sim_talker(run.manifest), records=run.requests,
                             events=summary.request_events(run))

    result = fidelity.compare(side(sim_run), side(real_run))
    if json_path is not None:
        try:
            write_file_atomic(json_path, json.dumps(fidelity.as_json(result), indent=2) + "\n")
        except OSError as exc:
            raise UserError(f"--json {json_path}: cannot write ({exc.strerror or exc})") from None
    click.echo(fidelity.render_text(result), nl=False)
