"""``omni-stress list``: the arms, deploys and prompt sets available, with what each sets."""

from __future__ import annotations

import dataclasses

import click

from harness.config import DEPLOY_DIR, NOT_DEPLOYS, PROMPT_DIR, list_yaml, load_arms, load_deploy, load_prompts
from harness.tokenizer import tokenize


def _settings(obj: object) -> str:
    return ", ".join(f"{f.name}={getattr(obj, f.name)}" for f in dataclasses.fields(obj)  # type: ignore[arg-type]
                     if getattr(obj, f.name) is not None)


@click.command("list")
@click.argument("what", type=click.Choice(["all", "families", "arms", "deploys", "prompts", "sweeps"]), default="all")
def command(what: str) -> None:
    """Show model families, arms, deploys, prompt sets and sweeps."""
    if what in ("all", "families"):
        from harness.family import family_names, get_family

        click.echo("Model families (harness/families/; a deploy's family:, or --family):")
        for name in family_names():
            fam = get_family(name)
            click.echo(f"  {fam.name:<12} {' -> '.join(fam.stages)}; {fam.stage}'s {fam.hook} under test\n"
                       f"  {'':<12} real server: {fam.request_api}, trace {fam.trace_target}; conform model "
                       f"{fam.conform_model}{' (not driven by --backend vllm-omni yet)' if fam.serve_missing else ''}\n"
                       f"  {'':<12} defaults: --arm {' --arm '.join(fam.default_arms)} --deploy "
                       f"{' --deploy '.join(fam.default_deploys)} --prompts {fam.default_prompts}; sim Talkers "
                       f"{', '.join(fam.sim_talkers)}")
    if what in ("all", "arms"):
        from harness.serve.releases import arm_release, release_env

        click.echo("Arms (deploy_configs/arms.yaml; or --arm NAME=package.module:attr):")
        for arm in load_arms().values():
            serve = "no real-backend entry"
            if arm.serve:
                where = arm.serve.python or " ".join(arm.serve.command)
                serve = "serve: " + " ".join(filter(None, (where, arm.serve.release and
                                                           f"release {arm.serve.release}")))
            elif (release := arm_release(arm)) is not None:
                serve = f"serve: release {release} (its environment: {release_env(release)})"
            click.echo(f"  {arm.name:<10} {arm.talker} (role: {arm.role}, family: {arm.family})\n  {'':<10} {arm.description}\n"
                       f"  {'':<10} {serve}")
    if what in ("all", "deploys"):
        from harness.sim.scheduler import resolve_talker  # local: keeps the CLI's start-up light

        click.echo("Deploys (deploy_configs/):")
        for name in list_yaml(DEPLOY_DIR, exclude=NOT_DEPLOYS):
            d = load_deploy(name)
            r = resolve_talker(d)
            click.echo(f"  {d.name:<10} {d.description}\n  {'':<10} talker: {_settings(d.talker)}\n"
                       f"  {'':<10} sim runs: {_settings(r)}\n  {'':<10} sampling: {_settings(d.sampling)}"
                       + (f"\n  {'':<10} speculative: {_settings(d.speculative)}" if d.speculative else ""))
    if what in ("all", "prompts"):
        from harness.family import get_family

        click.echo("Prompt sets (prompts/):")
        for name in list_yaml(PROMPT_DIR):
            ps = load_prompts(name)
            lens = get_family(ps.family, f"{ps.path}: family").talker_prompt_lens(ps)
            replies = [len(tokenize(p.reply)) for p in ps.prompts]
            voices = list(dict.fromkeys(p.speaker for p in ps.prompts if p.speaker))  # in the set's order
            embeddings = {p.speaker_embedding for p in ps.prompts if p.speaker_embedding is not None}
            if embeddings:  # a Base set: its voices are vectors, counted
                size = len(next(iter(embeddings)))
                voices = [f"{len(embeddings)} speaker embedding{'s' if len(embeddings) > 1 else ''} of {size} values"]
            click.echo(f"  {ps.name:<10} {len(ps.prompts)} prompts; Talker prompt length P {min(lens)}-{max(lens)}; "
                       f"reply tokens {min(replies)}-{max(replies)}" + (f"; voices {', '.join(voices)}" if voices else "")
                       + f"\n  {'':<10} {ps.description}")
    if what in ("all", "sweeps"):
        from harness.sweep.grid import list_sweeps, load_sweep

        click.echo("Sweeps (deploy_configs/sweeps/; omni-stress sweep NAME):")
        for name in list_sweeps():
            sw = load_sweep(name)
            axes = "; ".join(f"{a.key}: {', '.join(a.labels)}" for a in sw.axes)
            ref = sw.reference.name if sw.reference is not None else "none"
            click.echo(f"  {sw.name:<10} {len(sw.points)} points around {sw.base.name} (reference {ref})\n"
                       f"  {'':<10} {axes}\n  {'':<10} {sw.description}")
