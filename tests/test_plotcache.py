"""``report`` reuses the PNGs a run drew only while nothing they show changed (harness.report.plotcache)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.report import plotcache
from harness.report import tables as report


def _pngs(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "plots").glob("*.png"))}


def test_reused_pngs_are_the_drawn_ones_and_changes_redraw(small_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(small_run, run_dir)
    key_file = run_dir / "plots" / plotcache.RENDER_KEY_FILE
    assert key_file.is_file()  # omni-stress run recorded its plots
    run = report.load_run(run_dir)
    cells = report.summarize_cells(run)
    key = plotcache.render_key(run, cells)
    assert plotcache.cached_images(run_dir / "plots", key) is not None
    drawn_by_run = _pngs(run_dir)

    key_file.unlink()  # drawn again: the same bytes
    report.write_reports(run_dir)
    assert _pngs(run_dir) == drawn_by_run and key_file.is_file()
    html = (run_dir / "report.html").read_bytes()
    report.write_reports(run_dir)  # reused
    assert _pngs(run_dir) == drawn_by_run and (run_dir / "report.html").read_bytes() == html

    (run_dir / "plots" / "wer.png").write_bytes(b"not a png")  # a replaced PNG is drawn again
    assert plotcache.cached_images(run_dir / "plots", key) is None
    report.write_reports(run_dir)
    assert _pngs(run_dir) == drawn_by_run

    lines = (run_dir / "requests.jsonl").read_text().splitlines()  # a changed record changes the key
    rec = json.loads(lines[0])
    rec["oracle_wer"] = 0.75
    (run_dir / "requests.jsonl").write_text("\n".join([json.dumps(rec, sort_keys=True)] + lines[1:]) + "\n")
    changed = report.load_run(run_dir)
    assert plotcache.render_key(changed, report.summarize_cells(changed)) != key
    report.write_reports(run_dir)
    assert _pngs(run_dir)["wer.png"] != drawn_by_run["wer.png"]


def test_a_run_built_by_hand_is_always_drawn(small_run: Path) -> None:
    run = report.load_run(small_run)
    by_hand = report.Run(run.run_dir, run.manifest, run.requests, list(run.spans))
    assert by_hand.digest is None and plotcache.render_key(by_hand, report.summarize_cells(by_hand)) is None
