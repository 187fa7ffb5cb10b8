"""The HTML pages read at a glance: what can be checked without a browser (scripts/check_html.py opens them
in headless Chromium: no sideways scrolling at 1400 px, the audio players load, screenshots).

report.html links each request's WAV beside it (no base64 audio), the sweep page colours a baseline's
bug as expected and captions its heatmaps, the conform page has a table of contents, collapsible
per-model details and an upstream table that says each line once."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest

from harness.report import tables as report
from harness.conform.check import ModelResult
from harness.conform.compare import Cell
from harness.conform.report import Matrix, Report, format_html
from conftest import REPO, invoke_cli
from test_report import _cells, write_run


class _Tags(HTMLParser):
    """Every start tag with its attributes, and the text inside each tag name asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.ids: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        self.tags.append((tag, a))
        if a.get("id"):
            self.ids.append(str(a["id"]))

    def of(self, tag: str) -> list[dict[str, str | None]]:
        return [a for t, a in self.tags if t == tag]


def _parse(page: str) -> _Tags:
    p = _Tags()
    p.feed(page)
    return p


# --------------------------------------------------------------------------- report.html


@pytest.fixture(scope="module")
def audio_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The seed-shaped run with a (fake) WAV per request under audio/, one of them with an odd name."""
    run_dir = write_run(tmp_path_factory.mktemp("html"), "audio", with_spans=False)
    lines = []
    for line in (run_dir / "requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        name = f"{rec['arm']}-{rec['deploy']}-{rec['repeat']}-{rec['prompt_id']}"
        if rec["prompt_id"] == "p03":
            name += " #1"  # a space and a '#': quoted in the URL
        rec["audio_path"] = f"audio/{name}.wav"
        (run_dir / "audio").mkdir(exist_ok=True)
        (run_dir / rec["audio_path"]).write_bytes(b"RIFF" + bytes(40_000))  # ~40 kB each, 96 of them
        lines.append(json.dumps(rec))
    (run_dir / "requests.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def test_report_links_the_audio_beside_the_page(audio_run: Path) -> None:
    written = report.write_reports(audio_run)
    page = written["html"].read_text()
    assert "data:audio" not in page and "base64" not in page.replace("data:image/png;base64,", "")
    assert len(page) < 600_000  # 96 WAVs of 40 kB inlined would be ~5 MB
    tags = _parse(page)
    players = tags.of("audio")
    links = [a["href"] for a in tags.of("a") if a.get("class") == "wav"]
    assert len(players) == 8 and len(links) == 96  # the 4 worst requests and their references; every request
    for src in [str(a["src"]) for a in players] + [str(h) for h in links]:
        assert not re.match(r"^[a-z]+:", src) and not src.startswith("/")  # relative: no scheme, no root
        assert (audio_run / unquote(src)).is_file(), src
    assert any("%20%231.wav" in str(h) for h in links)  # 'p03 #1.wav' quoted
    assert all(a.get("preload") == "metadata" and "controls" in a for a in players)


def test_report_tables_scroll_in_their_own_box_and_the_toc_reaches_every_section(audio_run: Path) -> None:
    run, cells = _cells(audio_run)
    page = report.html_report(run, cells, {"wer": b"\x89PNG\r\n\x1a\n"})
    tables = page.count("<table")
    assert tables == 4 and page.count("<div class=\"scroll\"><table") == tables
    tags = _parse(page)
    toc = [str(a["href"])[1:] for a in tags.of("a") if str(a.get("href", "")).startswith("#")]
    assert toc == ["summary", "wer", "extended", "paired", "requests"] and set(toc) <= set(tags.ids)
    assert "overflow-x:auto" in page and "max-width:100%" in page


def test_report_per_request_rows_group_cells_and_show_transcripts(audio_run: Path) -> None:
    run, cells = _cells(audio_run)
    page = report.html_report(run, cells, {})
    requests = page.split("<table class=\"requests\">")[1].split("</table>")[0]
    groups = re.findall(r"<tr class=\"group\"><th colspan=\"\d+\">([^<]+)</th>", requests)
    assert groups[0] == "main (baseline), reference deploy, run 1: 16 requests, mean WER 0.017"
    assert len(groups) == 6 and requests.count("<tr>") == 96 + 1  # and the header row
    assert requests.count("<td class=\"text\">hello there</td>") == 95  # the 96th failed: its error first
    # the failed request: its error in the summary, its transcript folded under it
    assert ("<td class=\"text\"><details><summary><span class=\"warn\">error: boom</span></summary>"
            "<p>hello there</p></details></td>") in requests
    assert requests.count("<td class=\"bad\">") == 32  # WER over 0.5: main under stress, both runs
    header = requests.split("</thead>")[0]
    assert "<th>Arm</th>" not in header and "Transcript" in header  # arm, deploy and run: in the group row


def test_report_folds_long_transcripts_and_errors() -> None:
    """A transcript over FOLD_AT characters is one line, its first words, the rest on a click (<details>);
    a long error's first words are the summary, the whole error above the transcript when opened."""
    text = "the quick brown fox jumps over the lazy dog " * 3  # 132 characters
    assert report.FOLD_AT == 60
    assert report._folded(text.strip(), "") == (
        "<details><summary>the quick brown fox jumps over the lazy dog the quick brown…</summary>"
        f"<p>{text.strip()}</p></details>")
    assert report._folded("short & sweet", "") == "short &amp; sweet"  # short: as it is, no fold
    assert report._folded("", "") == "<span class=\"empty\">(no words)</span>"
    error = "server said: " + "x" * 70
    assert report._folded("hi", error) == (
        "<details><summary><span class=\"warn\">error: server said…</span></summary>"
        f"<p><span class=\"warn\">error: {error}</span><br>hi</p></details>")


def _gated(run_dir: Path):  # type: ignore[no-untyped-def]
    """The hand-made run's verdict from the default rules (the run itself is not complete, so the
    page's ``page_verdict`` would refuse it: this is the evaluation it makes of a complete one)."""
    from harness.gate import DEFAULT_RULES, evaluate, load_rules
    from harness.gate.verdict import PageVerdict, arm_lines, cell_outcomes

    run, cells = _cells(run_dir)
    result = evaluate(load_rules(DEFAULT_RULES), cells)
    return run, cells, PageVerdict("gates.yaml", arm_lines(result, cells), outcomes=cell_outcomes(result))


def test_run_page_opens_with_the_gate_verdict_per_arm(tmp_path: Path) -> None:
    """main (baseline) passes, its bug detected; pr fails candidate-contract (one request of its second
    stress run ended in an error): the failing rule named, coloured per arm, the checks as the tooltip."""
    from harness.gate.verdict import verdict_text

    run, cells, verdict = _gated(write_run(tmp_path, "spans"))
    assert verdict_text(verdict) == (
        "Gate (gates.yaml): main — passes 2 rules (the expected bug detected under stress) · pr — fails "
        "candidate-contract on stress run 2 (errors 1 > 0); 2 other rules pass")
    assert verdict.html == (
        "<p class=\"verdict fail\"><b>Gate</b> (gates.yaml): <span class=\"arm pass\"><b>main</b> "
        "<span class=\"role\">(baseline)</span> — passes 2 rules (the expected bug detected under stress)</span> · "
        "<span class=\"arm fail\" title=\"candidate-contract: pr/stress run 2 [candidate]: max_errors: requests that "
        "ended in an error = 1 &gt; 0\"><b>pr</b> <span class=\"role\">(candidate)</span> — fails candidate-contract "
        "on stress run 2 (errors 1 &gt; 0); 2 other rules pass</span></p>")
    page = report.html_report(run, cells, {}, verdict)
    assert page.split("</h1>\n")[1].startswith(verdict.html)  # the first thing under the title
    # the summary: each row's deploy role, a tint only where something is wrong (or wrong as expected)
    summary = page.split("<table class=\"summary\">")[1].split("</table>")[0]
    rows = re.findall(r"<tr class=\"([a-z ]+)\"", summary)
    assert rows == ["reference", "stress expected", "reference", "stress fail"]
    assert summary.count("<td title=\"stress deploy\">") == 2  # its bar in the role's colour
    assert summary.count("<td class=\"bad\">") == 1  # main's stress WER, over 0.5
    headings = " ".join(re.findall(r"<(?:h1|h2|title|nav)[^>]*>(.*?)</(?:h1|h2|title|nav)>", page, re.S))
    assert "Summary" in headings and "seed" not in headings.lower()  # the seed experiment is history


def test_verdict_line_names_every_failing_rule(audio_run: Path) -> None:
    """A run without spans stressed nothing: each failing rule named with where and by how much."""
    from harness.gate.verdict import verdict_text

    assert verdict_text(_gated(audio_run)[2]) == (
        "Gate (gates.yaml): main — fails baseline-stress-shows-bug on stress run 1, stress run 2 "
        "(misaligned_text_positions 0 < 1); 1 other rule passes · pr — fails candidate-contract on stress run 2 "
        "(errors 1 > 0); candidate-stress-matches-reference on stress run 1, stress run 2 (nonzero_offset_chunks "
        "0 < 1); 1 other rule passes")


def test_verdict_line_of_a_passing_run_and_of_a_refused_one(tmp_path: Path) -> None:
    from harness.gate import DEFAULT_RULES, evaluate, load_rules
    from harness.gate.verdict import PageVerdict, arm_lines, page_verdict, verdict_text

    from test_report import SEED

    passing = {k: v for k, v in SEED.items() if k[0] == "pr"}
    run, cells = _cells(write_run(tmp_path, "ok", seed=passing))
    result = evaluate(load_rules(DEFAULT_RULES), cells)
    line = PageVerdict("gates.yaml", arm_lines(result, cells))
    assert verdict_text(line) == "Gate (gates.yaml): pr — passes 3 rules"
    assert line.html.startswith("<p class=\"verdict pass\">") and "<span class=\"arm pass\">" in line.html
    refused = page_verdict(run, cells)  # the hand-made run never finished: the gate refuses it
    assert refused.status == "error" and verdict_text(refused).startswith(
        "Gate (gates.yaml): not evaluated (the gate refuses the run): incomplete run (2 problems): the run did not finish")


def test_report_without_audio_says_so(tmp_path: Path) -> None:
    page = report.html_report(*_cells(write_run(tmp_path, "noaudio", with_spans=False)), {})
    assert "<audio" not in page and page.count("stress: no audio") == 4
    requests = page.split("<table class=\"requests\">")[1]
    assert "class=\"wav\"" not in requests


# --------------------------------------------------------------------------- sweep.html


@pytest.fixture(scope="module")
def tiny_sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    res = invoke_cli("sweep", str(REPO / "tests/data/sweep_tiny.yaml"), "--prompts",
                     str(REPO / "tests/data/prompts_e2e.yaml"), "--quiet", "--no-cache", "--asr", "none",
                     "--out", str(out), "--run-id", "tiny")
    assert res.exit_code == 0, res.stderr
    return out / "tiny"


@pytest.fixture(scope="module")
def tiny_sweep_page(tiny_sweep: Path) -> str:
    return (tiny_sweep / "sweep.html").read_text()


def test_sweep_page_colours_a_baselines_bug_as_expected(tiny_sweep_page: str) -> None:
    rows = re.findall(r"<tr class='([a-z-]+)' data-status='([a-z-]+)'>", tiny_sweep_page)
    by_status = {status: cls for cls, status in rows}
    assert by_status["bug"] == "expected" and by_status["pass"] == "pass"  # main's bug: blue, not green
    assert by_status["unstressed"] == "unstressed" and by_status["reference"] == "reference"
    css = tiny_sweep_page.split("<style>")[1].split("</style>")[0]
    colour = {m.group(1): m.group(2) for m in re.finditer(r"tr\.([a-z-]+) td\{background:(#[0-9a-f]+)", css)}
    assert colour["expected"] not in (colour["pass"], colour["fail"])
    assert "<span class='badge expected'>bug (expected)</span>" in tiny_sweep_page


def test_sweep_page_opens_with_the_map_gates_verdict(tiny_sweep_page: str) -> None:
    """One line under the title: the map gate per arm, coloured, before the map itself."""
    line = tiny_sweep_page.split("</h1>\n")[1].split("\n")[0]
    assert re.fullmatch(r"<p class='verdict (pass|fail|error)'><b>Map gate</b> \(gates\.yaml\): "
                        r"<span class='arm (pass|fail|error)'><b>main</b> <span class='role'>\(baseline\)</span> — .+"
                        r" · <span class='arm (pass|fail|error)'><b>pr</b> <span class='role'>\(candidate\)</span> — "
                        r".+</span></p>", line), line
    assert tiny_sweep_page.index("class='verdict") < tiny_sweep_page.index("<h2 id='map'>")


def test_sweep_page_point_column_does_not_repeat_the_axes(tiny_sweep_page: str) -> None:
    table = tiny_sweep_page.split("<table class='map'>")[1].split("</table>")[0]
    head = re.findall(r"<th[^>]*>([^<]*)</th>", table.split("</thead>")[0])
    assert head[:3] == ["Arm", "mnbt", "load"] and "Point" not in head
    assert "@mnbt" not in table  # the point's name is its axes' values, in their columns
    assert table.count("(reference)</td>") == 2 and table.count("rowspan='5'") == 2  # each arm said once


def test_sweep_page_heatmaps_have_captions_and_colour_bars(tiny_sweep_page: str) -> None:
    figures = re.findall(r"<figure id='([^']+)'[^>]*><img src='data:image/png;base64,[^']+' alt='[^']+'>"
                         r"<figcaption>(.*?)</figcaption></figure>", tiny_sweep_page)
    assert [f for f, _ in figures] == [f"{a}-{m}" for a in ("main", "pr")
                                       for m in ("wer", "over", "misaligned", "events", "latency")]
    for name, caption in figures:
        assert "Colour bar:" in caption and "x: mnbt (talker.max_num_batched_tokens)" in caption, name
        assert "one panel per load" in caption and "no stress" in caption
    assert "expected failure" in dict(figures)["main-wer"] and "expected failure" not in dict(figures)["pr-wer"]


def test_heatmaps_draw_a_colour_bar(tiny_sweep: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each heatmap figure has one axes per panel (two loads) and one more: its colour bar."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    from harness.sweep import report as sweep_report
    from harness.gate import DEFAULT_RULES, load_rules

    seen = []
    real = Figure.savefig

    def spy(fig, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append([ax.get_label() for ax in fig.axes])
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    sweep_report.heatmaps(sweep_report.build_map(tiny_sweep, load_rules(DEFAULT_RULES)))
    assert len(seen) == 10 and all(len(labels) == 3 and labels.count("<colorbar>") == 1 for labels in seen), seen


# --------------------------------------------------------------------------- the conform page


def _finding(column: str, line: int, why: str, reach: str, issue: int | None = None) -> dict:
    return {"column": column, "cell": "differs @3", "schedule": "P=4: [0,2) -> [2,4)", "file": "m/model.py",
            "line": line, "why": why, "issue": issue, "issue_why": "the restart class" if issue else None,
            "reach": reach}


def _matrix(source: str = "vllm-omni:x = X") -> Matrix:
    why = "talker_preprocess routes on the span length"
    up = ModelResult("qwen3-omni", "q", None, {"chunk": Cell("differs", "differs @3", "row 3 differs"),
                                               "tail": Cell("differs", "differs @3", "row 3 differs")},
                     upstream=[_finding("chunk", 10, why, "only with chunked prefill"),
                               _finding("tail", 10, why, "only with chunked prefill"),
                               _finding("restart", 20, "a prefill clears the frames", "reached by shipped deploy",
                                        6179)])
    ok = ModelResult("glm-tts", "g", None, {"chunk": Cell("conforms", "conforms"), "tail": Cell("conforms", "conforms")})
    return Matrix(source, (), [up, ok], [])


def test_conform_page_has_a_toc_collapsible_details_and_says_each_upstream_line_once() -> None:
    page = format_html(_matrix())
    tags = _parse(page)
    toc = page.split("<nav class='toc'>")[1].split("</nav>")[0]
    hrefs = re.findall(r"href='#([^']+)'", toc)
    assert hrefs[:3] == ["matrix", "upstream", "details"] and set(hrefs) <= set(tags.ids)
    assert "m-qwen3-omni" in hrefs and "m-glm-tts" in hrefs
    details = tags.of("details")
    assert [d["id"] for d in details] == ["m-qwen3-omni", "m-glm-tts"] and all("open" not in d for d in details)
    assert page.count("<summary>") == 2 and "row 3 differs" in page
    assert page.count("talker_preprocess routes on the span length") == 1  # two columns, one paragraph
    assert page.count("m/model.py:10") == 1 and page.count("only with chunked prefill") == 1
    assert "<h2>For upstream</h2>" in page and "<table>" in page and "<html>" in page
    assert "rowspan='3'" in page  # the model's name over its three findings


def test_conform_page_of_two_releases_keeps_ids_apart() -> None:
    page = format_html(Report([_matrix("vllm-omni:a = A"), _matrix("vllm-omni:b = B")]))
    ids = _parse(page).ids
    assert len(ids) == len(set(ids)) and {"r0-matrix", "r1-matrix", "r0-m-qwen3-omni", "r1-m-qwen3-omni"} <= set(ids)
    toc = page.split("<nav class='toc'>")[1].split("</nav>")[0]
    assert set(re.findall(r"href='#([^']+)'", toc)) <= set(ids)
    assert page.count("<details") == 4
    head = page.split("</h1>\n")[1].split("</p>")[0]
    assert head == ("<p class='verdict fail'><b>Verdict</b> (overall exit 1):<br>"
                    "<span class='arm fail'><b>vllm-omni:a</b>: 1 of 2 models do not conform; under a shipped deploy: "
                    "qwen3-omni; conforms: glm-tts (exit 1)</span><br>"
                    "<span class='arm fail'><b>vllm-omni:b</b>: 1 of 2 models do not conform; under a shipped deploy: "
                    "qwen3-omni; conforms: glm-tts (exit 1)</span>")


def test_conform_headline_counts_models_not_their_mode_rows() -> None:
    """A model checked under two runner modes is two rows of the matrix and one model in the headline:
    the counts add up (failing + conforming = models), the rows said beside them, the exit code once."""
    from harness.conform.report import release_line
    from harness.conform.reach import ModelReach

    def row(model: str, status: str, reach: str | None = None) -> ModelResult:
        r = ModelResult(model, model, None, {"chunk": Cell(status, status, status)})
        if reach is not None:
            r.reach = ModelReach(status=reach, text=f"fails ({reach})")
        return r

    m = Matrix("vllm-omni:0.32.0rc1 = X", (), [
        row("qwen2.5-omni", "differs", "only"), row("qwen3-tts", "differs", "shipped"),
        row("qwen3-tts@mrv2", "differs", "shipped"), row("minicpmo-4.5", "differs", "shipped"),
        row("minicpmo-4.5@mrv2", "differs", "only"), row("glm-tts", "conforms")], [])
    assert release_line(m) == ("fail", (
        "vllm-omni:0.32.0rc1: 3 of 4 models do not conform (5 of 6 rows, one per model and runner mode); "
        "under a shipped deploy: qwen3-tts, minicpmo-4.5; only with changed settings: qwen2.5-omni; conforms: "
        "glm-tts (exit 1)"))
    only = Matrix("vllm-omni:a = A", (), [row("qwen2.5-omni", "differs", "only")], [])
    assert release_line(only) == ("pass", "vllm-omni:a: 1 of 1 models do not conform; only with changed settings: "
                                          "qwen2.5-omni (exit 0 with --fail-on shipped; --fail-on any counts them)")
    page = format_html(m)
    assert page.split("</h1>\n")[1].startswith("<p class='verdict fail'><b>Verdict</b>: <span class='arm "
                                              "fail'><b>vllm-omni:0.32.0rc1</b>: 3 of 4 models do not conform")
    assert page.count("(exit 1)") == 1  # one release: its line is the page's headline, said once
