"""Reports from a hand-made run directory that reproduces the seed's table exactly."""

from __future__ import annotations

import base64
import csv
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.contract import EVENT_FIELDS, classify_spans
from harness.report import tables as report
from harness.cli import main
from harness.records import EventCounts, JsonlWriter, RequestRecord, SpanRecord, write_manifest

P = 90
PROMPTS = [f"p{i:02d}" for i in range(1, 17)]

# (arm, deploy, repeat) -> (mean WER, requests over 0.5, non-zero-offset chunks, cross-boundary replays)
SEED = {
    ("main", "reference", 1): (0.017, 0, 0, 0),
    ("main", "stress", 1): (0.933, 16, 45, 7),
    ("main", "stress", 2): (0.925, 16, 47, 8),
    ("pr", "reference", 1): (0.020, 0, 0, 0),
    ("pr", "stress", 1): (0.016, 0, 91, 26),
    ("pr", "stress", 2): (0.016, 0, 92, 26),
}


def _scores(mean: float, over: int) -> list[float]:
    """16 scores with exactly this mean: all failing around the mean, or 15 zeros and one outlier."""
    if over == 16:
        return [mean + (0.05 if i % 2 else -0.05) for i in range(16)]
    return [0.0] * 15 + [round(mean * 16, 6)]


def _spans(arm: str, deploy: str, repeat: int, cell: tuple, base: int, offset: int = 0) -> list[SpanRecord]:
    """Spans giving exactly the cell's counts: per request a first chunk [0, 32), its share of
    non-zero-offset chunks, its share of replays [0, P+5) crossing P, then 3 decode steps.
    ``main`` returns all P rows on every prefill call (the seed's row-count mismatch); its
    non-zero-offset chunks are misaligned in the text region and its decode steps in the end region."""
    _, _, nonzero, cross = cell
    out = []
    step = base
    for i, pid in enumerate(PROMPTS):
        def span(c: int, n: int, pid: str = pid) -> SpanRecord:
            nonlocal step
            step += 1
            rows = P if (arm == "main" and c < P) else n
            return SpanRecord(arm, deploy, repeat + offset, pid, step, P, c, n, rows,
                              misaligned_text=(n if arm == "main" and c > 0 and c < P else 0),
                              misaligned_end=(1 if arm == "main" and c >= P else 0))
        if deploy == "reference":
            out.append(span(0, P))
        else:
            out.append(span(0, 32))
            for j in range(nonzero // 16 + (i < nonzero % 16)):
                out.append(span(32, 32) if j % 2 == 0 else span(64, P - 64))
            for _ in range(cross // 16 + (i < cross % 16)):
                out.append(span(0, P + 5))
        for k in range(3):
            out.append(span(P + k, 1))
    return out


def write_run(root: Path, name: str = "seed", whisper: bool = True, with_spans: bool = True,
              repeat_offset: int = 0, shuffle: bool = True, seed: dict | None = None) -> Path:
    """A run dir shaped like the seed experiment; records in a scrambled order (the table must not care)."""
    seed = seed or SEED
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cells = list(seed)
    records, spans = [], []
    for n, key in enumerate(cells):
        arm, deploy, repeat = key
        mean, over, _, cross = seed[key]
        for i, (pid, score) in enumerate(zip(PROMPTS, _scores(mean, over))):
            # each cross-boundary replay (span(0, P + 5)) ends 5 positions into the reply's text
            ev = EventCounts(talker_calls=1, prefill_calls=1, replays_ending_in_text=cross // 16 + (i < cross % 16))
            records.append(RequestRecord(
                arm=arm, deploy=deploy, repeat=repeat + repeat_offset, prompt_id=pid, backend="sim",
                reference_text="hello there", num_codec_tokens=100 + i, finish_reason="stop",
                oracle_transcript="hello there", oracle_wer=1.0 if over else 0.0,
                transcript="hello there" if whisper else None, wer=score if whisper else None,
                preemptions=1 if deploy == "stress" and i < 2 else 0, events=ev, wall_s=0.5,
                error="boom" if (key == ("pr", "stress", 2) and i == 15 and seed is SEED) else None,
            ))
        if not whisper:  # oracle-only run: put the scores on oracle_wer
            for rec, score in zip(records[-16:], _scores(mean, over)):
                rec.oracle_wer = score
        if with_spans:
            spans += _spans(arm, deploy, repeat, seed[key], base=1000 * n, offset=repeat_offset)
    if shuffle:
        records = records[1::2] + records[0::2]
    w = JsonlWriter(run_dir / "requests.jsonl")
    w.write_many(records)
    w.close()
    if with_spans:
        w = JsonlWriter(run_dir / "spans.jsonl")
        w.write_many(spans)
        w.close()
    write_manifest(run_dir, {
        "run_id": name, "argv": ["omni-stress", "run", "--arm", "main", "--arm", "pr", "--repeat", "2"],
        "cells": [{"arm": a, "deploy": d, "repeat": r + repeat_offset} for a, d, r in cells],
        "arms": [{"name": a, "talker": "x:y", "role": "baseline" if a == "main" else "candidate"}
                 for a in dict.fromkeys(a for a, _, _ in cells)],
        "started": "2025-01-01T00:00:00Z", "finished": None, "backend": "sim",
        "asr": "faster-whisper base" if whisper else None,
    })
    return run_dir


SEED_ROWS = [
    ["main, reference deploy", "0.017", "0/16", "0", "0"],
    ["main, stress deploy (run 1 / run 2)", "0.933 / 0.925", "16/16 / 16/16", "45 / 47", "7 / 8"],
    ["pr, reference deploy", "0.020", "0/16", "0", "0"],
    ["pr, stress deploy (run 1 / run 2)", "0.016 / 0.016", "0/16 / 0/16", "91 / 92", "26 / 26"],
]


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_run(tmp_path_factory.mktemp("runs"))


@pytest.fixture(scope="module")
def written(seed_run: Path) -> dict[str, Path]:
    return report.write_reports(seed_run)


def _cells(run_dir: Path) -> tuple[report.Run, list[report.CellSummary]]:
    run = report.load_run(run_dir)
    return run, report.summarize_cells(run)


def test_seed_table_reproduces_the_seed(seed_run: Path) -> None:
    _, cells = _cells(seed_run)
    table = report.seed_table(cells)
    assert list(table.columns) == ["Arm", "WER (mean)", "Requests with WER > 0.5", "Non-zero-offset prefill chunks",
                                   "Replays crossing the prompt boundary"]
    assert table.values.tolist() == SEED_ROWS


def test_extended_table_cells(seed_run: Path) -> None:
    _, cells = _cells(seed_run)
    ext = report.extended_table(cells)
    rows = {(r["Arm"], r["Deploy"], r["Run"]): r for r in ext.to_dict(orient="records")}
    main1, main2 = rows[("main", "stress", "1")], rows[("main", "stress", "2")]
    assert main1["Row-count mismatches / prefill calls"] == "68/68"
    assert main2["Row-count mismatches / prefill calls"] == "71/71"
    assert rows[("pr", "stress", "1")]["Row-count mismatches / prefill calls"] == "0/133"
    assert rows[("main", "reference", "1")]["Row-count mismatches / prefill calls"] == "0/16"
    assert main1["WER (median)"] == "0.933"
    assert main1["Oracle WER (mean)"] == "1.000"
    # main returns P rows on every prefill call; misaligned = n of each non-zero-offset chunk:
    # 13 requests get chunks 32+26+32, 3 get 32+26 (text region); one per decode step (end region)
    assert main1["Misaligned (text)"] == str(13 * 90 + 3 * 58)
    assert main1["Misaligned (end)"] == str(16 * 3)
    assert rows[("pr", "stress", "1")]["Misaligned (text)"] == rows[("pr", "stress", "1")]["Misaligned (end)"] == "0"
    # the worst request of each cell: main's odd prompts are at mean + 0.05, pr's last prompt carries its mean
    assert main1["Worst request"] == "p02 (0.983)"
    assert rows[("pr", "stress", "1")]["Worst request"] == "p16 (0.256)"
    assert rows[("pr", "stress", "2")]["Errors"] == "1"
    assert main1["Preemptions"] == "2"
    assert main1["Multi-position decode spans"] == "0"
    assert main1["WER source"] == "Whisper"
    assert main1["Wall time (s)"] == "8.0"
    assert list(ext["Arm"] + "/" + ext["Deploy"] + "/" + ext["Run"]) == [
        "main/reference/1", "main/stress/1", "main/stress/2", "pr/reference/1", "pr/stress/1", "pr/stress/2"]


def test_wer_source_note(seed_run: Path, tmp_path: Path) -> None:
    run, cells = _cells(seed_run)
    assert report.wer_source_note(run, cells) == "WER source: Whisper (faster-whisper base)"
    run, cells = _cells(write_run(tmp_path, "oracle", whisper=False, with_spans=False))
    assert report.wer_source_note(run, cells).startswith("WER source: oracle transcript")
    assert report.seed_table(cells).values.tolist()[1][1] == "0.933 / 0.925"  # oracle WER is scored


def test_zero_based_repeats_and_manifest_order(tmp_path: Path) -> None:
    seed = {("pr", "reference", 1): (0.02, 0, 0, 0), ("pr", "stress", 1): (0.016, 0, 91, 26),
            ("pr", "stress", 2): (0.02, 0, 92, 26), ("main", "reference", 1): (0.017, 0, 0, 0)}
    _, cells = _cells(write_run(tmp_path, "zero", repeat_offset=-1, seed=seed))
    rows = report.seed_table(cells).values.tolist()
    assert [r[0] for r in rows] == ["pr, reference deploy", "pr, stress deploy (run 1 / run 2)",
                                    "main, reference deploy"]
    assert rows[1][1:] == ["0.016 / 0.020", "0/16 / 0/16", "91 / 92", "26 / 26"]


def test_events_fall_back_to_request_records(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "nospans", with_spans=False)
    _, cells = _cells(run_dir)
    assert all(c.event_source == "requests" for c in cells)
    # each record carries EventCounts(talker_calls=1, prefill_calls=1)
    assert report.extended_table(cells)["Row-count mismatches / prefill calls"].tolist()[0] == "0/16"


def test_markdown_and_terminal(seed_run: Path) -> None:
    run, cells = _cells(seed_run)
    md = report.markdown_text(run, cells)
    assert "| main, stress deploy (run 1 / run 2) | 0.933 / 0.925 | 16/16 / 16/16 | 45 / 47 | 7 / 8 |" in md
    assert "| Arm | WER (mean) | Requests with WER > 0.5 |" in md
    text = report.terminal_table(seed_run)
    line = next(ln for ln in text.splitlines() if ln.startswith("main, stress deploy (run 1 / run 2)"))
    assert line.split("  ")[0] == "main, stress deploy (run 1 / run 2)"
    assert [p.strip() for p in line.split("  ") if p.strip()][1:] == SEED_ROWS[1][1:]
    assert "WER source: Whisper" in text
    assert any("68/68" in ln for ln in text.splitlines())


class _Collector(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tables = 0
        self.cells: list[str] = []
        self.images: list[str] = []
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self.tables += 1
        if tag in ("td", "th"):
            self._in_cell = True
            self.cells.append("")
        if tag == "img":
            self.images.append(dict(attrs)["src"])

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._in_cell:
            self.cells[-1] += data


def test_write_reports_files(written: dict[str, Path], seed_run: Path) -> None:
    assert {"csv", "markdown", "json", "html", "requests_csv", "plot_wer", "plot_events", "plot_timeline"} <= set(
        written)
    for path in written.values():
        assert path.is_file() and path.stat().st_size > 0 and path.parent in (seed_run, seed_run / "plots")

    with open(written["csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    main1 = next(r for r in rows if (r["arm"], r["deploy"], r["repeat"]) == ("main", "stress", "1"))
    assert float(main1["wer_mean"]) == pytest.approx(0.933)
    assert (main1["prefill_row_count_mismatches"], main1["prefill_calls"]) == ("68", "68")
    assert main1["nonzero_offset_chunks"] == "45" and main1["cross_boundary_replays"] == "7"

    data = json.loads(written["json"].read_text())
    assert data["wer_source"] == "whisper"
    assert [list(r.values()) for r in data["seed_table"]] == SEED_ROWS
    assert len(data["requests"]) == 96 and len(data["cells"]) == 6
    assert written["markdown"].read_text().count("0.933 / 0.925") == 1

    with open(written["paired_csv"], newline="") as fh:
        paired = list(csv.DictReader(fh))
    assert len(paired) == 4 * 16  # main and pr, stress run 1 and 2, 16 prompts each
    row = next(r for r in paired if (r["arm"], r["repeat"], r["prompt"]) == ("main", "1", "p02"))
    assert (row["role"], row["reference_deploy"], row["worst_of_cell"]) == ("baseline", "reference", "True")
    assert float(row["wer_delta"]) == pytest.approx(0.983) and float(row["oracle_wer_delta"]) == 1.0
    assert len(data["paired"]) == 64 and data["roles"] == {"main": "baseline", "pr": "candidate"}
    assert data["complete"] is False and data["problems"][0].startswith("the run did not finish")
    main1_json = next(c for c in data["cells"] if (c["arm"], c["deploy"], c["repeat"]) == ("main", "stress", 1))
    assert (main1_json["misaligned_text_positions"], main1_json["misaligned_end_positions"]) == (13 * 90 + 3 * 58, 48)
    assert (main1["misaligned_text_positions"], main1["worst_request"], main1["role"]) == (
        str(13 * 90 + 3 * 58), "p02", "baseline")

    parser = _Collector()
    parser.feed(written["html"].read_text())
    assert parser.tables == 4
    assert "0.933 / 0.925" in parser.cells and "16/16 / 16/16" in parser.cells and "68/68" in parser.cells
    assert "main, stress deploy (run 1 / run 2)" in parser.cells
    assert len(parser.images) == 3
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")


def test_html_plays_the_worst_requests_linked(tmp_path: Path) -> None:
    """The paired table's worst request of each cell carries its audio and the reference's, linked
    relative to report.html (the run directory's audio/), never inlined as base64."""
    run_dir = write_run(tmp_path, "audio", with_spans=False)
    lines = []
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        rec["audio_path"] = f"audio/{rec['arm']}-{rec['deploy']}-{rec['repeat']}-{rec['prompt_id']}.wav"
        (run_dir / "audio").mkdir(exist_ok=True)
        (run_dir / rec["audio_path"]).write_bytes(b"RIFF" + rec["audio_path"].encode())
        lines.append(json.dumps(rec))
    (run_dir / "requests.jsonl").write_text("\n".join(lines) + "\n")
    run, cells = _cells(run_dir)
    page = report.html_report(run, cells, {})
    paired = page.split('<table class="paired">')[1].split("</table>")[0]
    # main and pr, stress runs 1 and 2: main's worst requests are worse than their reference (tinted), pr's
    # are not (issue 46: no tint where nothing is wrong), all four carry the players
    assert paired.count('<tr class="worst">') == 2 and paired.count('<tr class="plays">') == 2
    assert paired.count("<audio controls") == 8  # each with the same prompt's reference audio
    assert 'src="audio/main-stress-1-p02.wav"' in paired and 'src="audio/main-reference-1-p02.wav"' in paired
    assert 'src="audio/main-stress-2-p02.wav"' in paired and 'src="audio/pr-reference-1-p16.wav"' in paired
    assert "base64" not in page.replace("data:image/png;base64", "")
    (run_dir / "audio" / "main-stress-2-p02.wav").unlink()
    assert "stress: audio/main-stress-2-p02.wav missing" in report.html_report(run, cells, {})
    no_audio = report.html_report(*_cells(write_run(tmp_path, "noaudio", with_spans=False)), {})
    assert no_audio.count("stress: no audio") == 4 and no_audio.count("reference: no audio") == 4


def test_spans_written_before_the_split_count_in_the_text_region(tmp_path: Path) -> None:
    """Old spans.jsonl lines carry only ``misaligned``: counted as text (the conservative reading)."""
    run_dir = write_run(tmp_path, "old")
    path = run_dir / "spans.jsonl"
    old = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        for key in ("misaligned_text", "misaligned_end", "is_prefill"):
            rec.pop(key)
        old.append(json.dumps(rec))
    path.write_text("\n".join(old) + "\n")
    _, cells = _cells(run_dir)
    main1 = next(c for c in cells if c.key == ("main", "stress", 1)).events
    assert (main1.misaligned_text_positions, main1.misaligned_end_positions) == (13 * 90 + 3 * 58 + 48, 0)
    assert main1.misaligned_positions == 13 * 90 + 3 * 58 + 48


def test_timeline_picks_a_stressed_request(seed_run: Path) -> None:
    from harness.report import plots

    run, _ = _cells(seed_run)
    deploy, _, prompt = plots.pick_stressed_request(run)
    assert deploy == "stress" and prompt == "p01"  # p01 gets the most replays (round-robin share)


def test_compare_table_deltas(seed_run: Path, tmp_path: Path) -> None:
    seed_b = dict(SEED)
    seed_b[("pr", "stress", 1)] = (0.026, 0, 91, 26)
    seed_b[("pr", "stress", 2)] = (0.026, 0, 94, 30)
    _, a = _cells(seed_run)
    _, b = _cells(write_run(tmp_path, "b", seed=seed_b))
    table = report.compare_table(a, b)
    pr = table[table["Arm"] == "pr, stress deploy"].iloc[0].tolist()
    assert pr == ["pr, stress deploy", "0.016 / 0.016", "0.026 / 0.026", "+0.010", "0/16 / 0/16", "0/16 / 0/16", "+0",
                  "91 / 92", "91 / 94", "+1", "26 / 26", "26 / 30", "+2", "0 / 0", "0 / 0", "+0", "0 / 0", "0 / 0", "+0"]
    main = table[table["Arm"] == "main, stress deploy"].iloc[0].tolist()
    assert main[-6:] == ["1344 / 1408", "1344 / 1408", "+0", "48 / 48", "48 / 48", "+0"]
    assert table[table["Arm"] == "main, reference deploy"].iloc[0].tolist()[3] == "+0.000"


def test_cli_report_and_compare(seed_run: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["report", str(seed_run), "--format", "markdown", "--no-write"])
    assert res.exit_code == 0, res.output
    assert "| pr, stress deploy (run 1 / run 2) | 0.016 / 0.016 | 0/16 / 0/16 | 91 / 92 | 26 / 26 |" in res.output
    res = runner.invoke(main, ["report", str(seed_run), "--format", "json", "--no-write"])
    assert res.exit_code == 0 and json.loads(res.stdout)["seed_table"][0]["WER (mean)"] == "0.017"
    assert res.stderr.startswith(f"omni-stress: warning: {seed_run}: incomplete run (1 problem): the run did not")
    res = runner.invoke(main, ["report", str(seed_run), "--format", "csv", "--no-write"])
    assert res.exit_code == 0 and res.stdout.splitlines()[0].startswith("arm,deploy,repeat,run,")
    res = runner.invoke(main, ["report", str(seed_run), "--paired", "--no-write"])
    assert res.exit_code == 0
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("main  stress    1  p02 "))
    assert line.split() == ["main", "stress", "1", "p02", "0.000", "0.983", "+0.983", "+1.000", "90", "3", "worst"]
    assert "Arms: main (baseline), pr (candidate)" in res.stdout
    assert "WARNING: incomplete run, the gate refuses it: the run did not finish" in res.stdout
    res = runner.invoke(main, ["compare", str(seed_run), str(seed_run)])
    assert res.exit_code == 0 and "0.933 / 0.925" in res.output and "+0.000" in res.output


def test_cli_report_writes_files(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "small", with_spans=False)
    res = CliRunner().invoke(main, ["report", str(run_dir)])
    assert res.exit_code == 0, res.output
    assert (run_dir / "report.html").is_file() and (run_dir / "summary.csv").is_file()
    assert not (run_dir / "plots" / "timeline.png").exists()  # no spans: no timeline


def test_bad_run_dirs_exit_2(tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(main, ["report", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "run directory not found" in res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = runner.invoke(main, ["report", str(empty)])
    assert res.exit_code == 2 and "no manifest.json" in res.output
    (empty / "manifest.json").write_text("{not json")
    res = runner.invoke(main, ["report", str(empty)])
    assert res.exit_code == 2 and "not valid JSON" in res.output
    (empty / "manifest.json").write_text(json.dumps({"run_id": "x", "cells": [{"arm": "main"}]}))
    res = runner.invoke(main, ["report", str(empty)])
    assert res.exit_code == 2 and "cells[0]" in res.output
    (empty / "manifest.json").write_text(json.dumps({"run_id": "x", "cells": []}))
    (empty / "requests.jsonl").write_text('{"arm": "main"\n{"arm": "x"}\n')
    res = runner.invoke(main, ["compare", str(empty), str(empty)])
    assert res.exit_code == 2 and "line 1: not valid JSON" in res.output


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "torn", with_spans=False)
    with open(run_dir / "requests.jsonl", "a") as fh:
        fh.write('{"arm": "main", "deploy": "stre')
    _, cells = _cells(run_dir)
    assert report.seed_table(cells).values.tolist()[1][1] == "0.933 / 0.925"


def test_cell_in_manifest_without_records(tmp_path: Path) -> None:
    """A killed run: the manifest names a cell no request of which completed."""
    run_dir = write_run(tmp_path, "partial", with_spans=False)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["cells"].append({"arm": "main", "deploy": "specdec", "repeat": 1})
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    _, cells = _cells(run_dir)
    assert report.seed_table(cells).values.tolist()[2] == ["main, specdec deploy", "n/a", "0/0", "0", "0"]
    assert report.extended_table(cells)["WER source"].tolist()[3] == "none"


# --------------------------------------------------------------------------- speculative decoding


def _spec_run(root: Path) -> Path:
    """Two cells: specdec (two requests with 1.5 and 2.0 accepted tokens/step, one without) and reference."""
    run_dir = root / "spec"
    run_dir.mkdir()
    recs = [
        RequestRecord(arm="pr", deploy="specdec", repeat=1, prompt_id="a", backend="sim", reference_text="x",
                      oracle_wer=0.0, accepted_tokens_per_step=1.5),
        RequestRecord(arm="pr", deploy="specdec", repeat=1, prompt_id="b", backend="sim", reference_text="x",
                      oracle_wer=0.0, accepted_tokens_per_step=2.0),
        RequestRecord(arm="pr", deploy="specdec", repeat=1, prompt_id="c", backend="sim", reference_text="x",
                      oracle_wer=0.0, error="raised before its first verify step"),
        RequestRecord(arm="pr", deploy="reference", repeat=1, prompt_id="a", backend="sim", reference_text="x",
                      oracle_wer=0.0),
    ]
    w = JsonlWriter(run_dir / "requests.jsonl")
    w.write_many(recs)
    w.close()
    # verify spans of k + 1 = 3 positions after a 10-position prefill
    spans = [SpanRecord("pr", "specdec", 1, "a", 1, 10, 0, 10, 10, misaligned=0),
             SpanRecord("pr", "specdec", 1, "a", 2, 10, 10, 3, 3, misaligned=0),
             SpanRecord("pr", "specdec", 1, "a", 3, 10, 12, 3, 3, misaligned=0)]
    w = JsonlWriter(run_dir / "spans.jsonl")
    w.write_many(spans)
    w.close()
    write_manifest(run_dir, {"run_id": "spec", "cells": [{"arm": "pr", "deploy": "specdec", "repeat": 1},
                                                         {"arm": "pr", "deploy": "reference", "repeat": 1}]})
    return run_dir


def test_accepted_tokens_per_step_column(tmp_path: Path) -> None:
    run, cells = _cells(_spec_run(tmp_path))
    spec, ref = cells
    assert spec.accepted_tokens_per_step == 1.75 and ref.accepted_tokens_per_step is None
    ext = report.extended_table(cells)
    assert ext["Accepted tokens/step"].tolist() == ["1.75", "\u2013"]
    assert ext["Multi-position decode spans"].tolist() == ["2", "0"]
    assert list(ext.columns).index("Accepted tokens/step") == list(ext.columns).index("Multi-position decode spans") + 1
    frame = report.cells_frame(cells)
    assert frame["accepted_tokens_per_step"].tolist()[0] == 1.75
    data = report.json_summary(run, cells)
    assert [c["accepted_tokens_per_step"] for c in data["cells"]] == [1.75, None]
    assert [r["Accepted tokens/step"] for r in data["requests"]] == ["1.50", "2.00", "\u2013", "\u2013"]
    text = report.terminal_text(run, cells)
    ext_lines = [ln.split() for ln in text.split("\n\n")[-1].splitlines()]  # "oracle transcript": 2 words
    assert [ln[14] for ln in ext_lines if ln[:2] in (["pr", "specdec"], ["pr", "reference"])] == ["1.75", "\u2013"]
    assert "| pr | specdec | 1 | 3 | oracle transcript | 0.000 | 0.000 | 0.000 | 0/3 | 0 | 0 | 0 | 2 | 1.75 |" in (
        report.markdown_text(run, cells))

    written = report.write_reports(run, cells)
    with open(written["csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["accepted_tokens_per_step"] for r in rows] == ["1.75", ""]
    assert "<td>1.75</td>" in written["html"].read_text()


@pytest.mark.slow
def test_specdec_run_shows_accepted_tokens(tmp_path: Path) -> None:
    """The sim's speculative-decoding deploy end to end: every cell reports 1 < accepted/step < 3 (k = 2)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--asr", "none", "--deploy", "specdec",
                           "--arm", "main", "--arm", "pr", "--prompts", str(root / "tests/fixtures/prompts_small.yaml"),
                           "--out", str(tmp_path), "--run-id", "spec", "--quiet"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "tokens/step" in proc.stdout and "Multi-position" in proc.stdout
    cells = json.loads((tmp_path / "spec" / "summary.json").read_text())["cells"]
    assert [(c["arm"], c["deploy"]) for c in cells] == [("main", "specdec"), ("pr", "specdec")]
    for c in cells:
        assert 1.0 < c["accepted_tokens_per_step"] < 3.0 and c["multi_position_decode_spans"] > 0
    for arm in ("main", "pr"):
        line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(f"{arm} ") and "specdec" in ln)
        assert f"{next(c for c in cells if c['arm'] == arm)['accepted_tokens_per_step']:.2f}" in line.split()


# --------------------------------------------------------------------------- loading (fast path)


def test_vectorised_events_match_the_contract(seed_run: Path) -> None:
    import itertools

    import numpy as np

    from harness.contract import classify_span, count_events

    grid = list(itertools.product(range(0, 5), range(0, 7), range(1, 6), range(0, 6)))
    P, c, n, rows = (np.array(col) for col in zip(*grid))
    flags = classify_spans(P, c, n, rows)
    for i, args in enumerate(grid):
        ev = classify_span(*args)
        assert {k: bool(v[i]) for k, v in flags.items()} == {k: getattr(ev, k) for k in EVENT_FIELDS}, args

    run = report.load_run(seed_run)
    groups: dict = {}
    for s in run.spans:
        groups.setdefault((s.arm, s.deploy, s.repeat, s.request), []).append(s)
    assert set(groups) == set(run.spans.group_events) and len(groups) == 96
    for key, spans in groups.items():
        assert run.spans.group_events[key] == (count_events(spans), True)


def test_reports_reuse_a_loaded_run(seed_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``omni-stress run`` reads the run once: the files and the terminal table come from that Run."""
    run, cells = _cells(seed_run)
    monkeypatch.setattr(report, "load_run", lambda *_: pytest.fail("read the run directory again"))
    assert "0.933 / 0.925" in report.terminal_table(run, cells)
    assert report.write_reports(run, cells)["html"].is_file()


def test_run_built_from_span_records(seed_run: Path) -> None:
    run = report.load_run(seed_run)
    by_hand = report.Run(run.run_dir, run.manifest, run.requests, list(run.spans))
    assert report.seed_table(report.summarize_cells(by_hand)).values.tolist() == SEED_ROWS


def test_spans_file_slow_path_and_errors(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, "spans")
    path = run_dir / "spans.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3]) + "\n" + "".join(lines[3:]) + '{"arm": "main", "dep')  # blank line, torn tail
    _, cells = _cells(run_dir)
    assert report.seed_table(cells).values.tolist() == SEED_ROWS

    cases = [
        ("not json\n", "line 2: not valid JSON"),
        ('{"arm": "main", "deploy": "stress", "repeat": 1, "request": "p01", "step": 1, "P": 9, "c": 0, "n": 3}\n',
         "line 2: malformed record (rows: expected an integer, missing)"),
        (lines[0].replace('"P": 90', '"P": "90"'), "line 2: malformed record (P: expected an integer, got '90')"),
        (lines[0].replace('"n": 90', '"n": 0'), "line 2: invalid span P=90 c=0 n=0"),
        ("[1, 2]\n", "line 2: malformed record (expected a JSON object)"),
    ]
    for bad, message in cases:
        path.write_text(lines[0] + bad + "".join(lines[1:]))
        with pytest.raises(report.UserError) as exc:
            report.load_run(run_dir)
        assert str(exc.value) == f"{path}: {message}", bad


def test_plots_drawn_in_a_forked_child_are_the_same_bytes(seed_run: Path, monkeypatch) -> None:
    """``render_all`` draws the timeline in a forked child beside the other two: same PNGs, same order."""
    import os
    import threading

    import harness.proc as proc
    from harness.report import plots

    run, cells = _cells(seed_run)
    monkeypatch.setenv("OMNI_STRESS_NO_FORK", "1")
    here = plots.render_all(run, cells)
    real, forked = proc.fork_call, []

    def counting(fn):
        child = real(fn)
        forked.append(child is not None)
        return child

    monkeypatch.setattr(proc, "fork_call", counting)
    monkeypatch.setenv("OMNI_STRESS_NO_FORK", "0")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    beside = plots.render_all(run, cells)
    assert list(here) == list(beside) == ["wer", "events", "timeline"]
    assert here == beside
    assert forked == [threading.active_count() == 1]  # the runner's own threads, if any, rule the fork out


def test_plots_pool_the_runs_of_a_run_of_many_cells() -> None:
    """Above plots.MAX_PLOT_CELLS cells the per-cell plots show one column per arm x deploy (issue 48:
    a 600-cell run's figure took over a minute): scores together, events and preemptions summed."""
    from harness.report.plots import MAX_PLOT_CELLS, _cell_label, plot_events, plot_wer, plotted_cells
    from harness.report.summary import CellSummary

    def cell(arm: str, deploy: str, repeat: int) -> CellSummary:
        return CellSummary(arm, deploy, repeat, 2, [0.1 * repeat, 0.0], [0.0, 0.0],
                           EventCounts(talker_calls=10, nonzero_offset_chunks=repeat), "spans", True, 1, 0, 1.0,
                           "oracle", repeat)

    few = [cell(a, d, r) for a in ("main", "pr") for d in ("reference", "stress") for r in (1, 2)]
    assert plotted_cells(few) == few
    many = [cell(a, d, r) for a in ("main", "pr") for d in ("reference", "stress") for r in range(1, 11)]
    assert len(many) > MAX_PLOT_CELLS
    pooled = plotted_cells(many)
    assert [(c.arm, c.deploy) for c in pooled] == [(a, d) for a in ("main", "pr") for d in ("reference", "stress")]
    first = pooled[0]
    assert first.scores == [s for c in many[:10] for s in c.scores] and first.requests == 20
    assert first.events.talker_calls == 100 and first.events.nonzero_offset_chunks == 55 and first.preemptions == 10
    assert _cell_label(first) == "main\nreference\n10 runs"
    assert many[0].events.talker_calls == 10  # the tables' cells are untouched
    assert plot_wer(many)[:8] == b"\x89PNG\r\n\x1a\n" and plot_events(many)[:8] == b"\x89PNG\r\n\x1a\n"
