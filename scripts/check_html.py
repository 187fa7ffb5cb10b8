#!/usr/bin/env python3
"""Open omni-stress's HTML pages in a real headless browser and check that they read at a glance.

For each page: the document's scroll width at a 1400 px wide viewport (no sideways scrolling:
``scrollWidth <= 1400``), every ``<img>`` decoded, every ``<audio>`` element's source loaded (its
metadata read: ``readyState >= 1`` and a finite ``duration``; the first one played, muted, and
its clock moving), every link to a local file (the
per-request ``wav`` links) pointing at a file that exists, and a full-page screenshot (PNG, 1400 px
wide, quantised to 256 colours (``--colors``) when Pillow is importable, so it stays small).

Needs Playwright's Python package and a Chromium binary; it never downloads a browser and never
touches the network (``file://`` pages only)::

    python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright pillow
    apt-get install -y chromium
    /tmp/pw/bin/python scripts/check_html.py run=results/r1/report.html \\
        sweep=results/SWEEP/sweep.html conform=m.html --shots docs/screenshots

Prints ``page | scrollWidth | images | audio playable | local links | ok | height`` and exits 1 when a page fails a check. Not part
of the test suite (CI has no browser); ``tests/test_report_html.py`` checks what can be checked
without one.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

WIDTH = 1400
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]

_PROBE = """async () => {
  const imgs = [...document.images];
  await Promise.all(imgs.map(i => i.complete ? null : new Promise(r => { i.onload = i.onerror = r; })));
  const audios = [...document.querySelectorAll('audio')];
  const loaded = await Promise.all(audios.map(a => new Promise(resolve => {
    const done = () => resolve({src: a.currentSrc || a.src, readyState: a.readyState, duration: a.duration,
                                error: a.error ? a.error.code : null});
    if (a.readyState >= 1) { done(); return; }
    a.addEventListener('loadedmetadata', done, {once: true});
    a.addEventListener('error', done, {once: true});
    setTimeout(done, 5000);
    a.preload = 'metadata';
    a.load();
  })));
  let played = null;  // the first player really plays: muted, its clock moves
  if (audios.length) {
    const a = audios[0];
    a.muted = true;
    try { await a.play(); await new Promise(r => setTimeout(r, 700)); played = a.currentTime; a.pause(); a.currentTime = 0; }
    catch (e) { played = String(e); }
  }
  return {scrollWidth: document.documentElement.scrollWidth, clientWidth: document.documentElement.clientWidth,
          height: document.documentElement.scrollHeight,
          links: [...document.querySelectorAll('a[href]')].map(a => a.href).filter(h => h.startsWith('file:')),
          images: imgs.length, imagesBroken: imgs.filter(i => !i.naturalWidth).map(i => i.alt || i.src.slice(0, 60)),
          audio: loaded, played: played};
}"""


def _shrink(png: bytes, colors: int = 256) -> bytes:
    """A ``colors``-colour PNG of the screenshot (a page of text and flat colours loses little)."""
    try:
        from PIL import Image
    except ImportError:
        return png
    img = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    img.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(png) else png


def check(pages: list[tuple[str, Path]], shots: Path | None, chromium: str, max_height: int,
          colors: int = 256) -> int:
    from playwright.sync_api import sync_playwright

    rows = []
    failed = False
    with tempfile.TemporaryDirectory(prefix="check-html-") as profile, sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(profile, executable_path=chromium, args=CHROMIUM_ARGS,
                                                    headless=True, viewport={"width": WIDTH, "height": 900},
                                                    device_scale_factor=1, offline=True)
        for name, path in pages:
            page = ctx.new_page()
            page.goto(path.resolve().as_uri(), wait_until="load")
            probe = page.evaluate(_PROBE)
            audio = probe["audio"]
            playable = [a for a in audio if a["readyState"] >= 1 and a["duration"] == a["duration"]
                        and a["duration"] not in (None, float("inf")) and a["duration"] > 0]
            links = [unquote(urlparse(h).path) for h in probe["links"]]
            broken = [h for h in links if not Path(h).exists()]
            played = probe["played"]
            plays = played is None or (isinstance(played, (int, float)) and played > 0)
            ok = (probe["scrollWidth"] <= min(WIDTH, probe["clientWidth"]) and not probe["imagesBroken"] and len(playable) == len(audio)
                  and not broken and plays)
            if not plays:
                print(f"{name}: the first audio player did not play: {played}", file=sys.stderr)
            failed |= not ok
            rows.append((name, probe["scrollWidth"], f"{probe['images'] - len(probe['imagesBroken'])}/{probe['images']}",
                         f"{len(playable)}/{len(audio)}" + (f", played {played:.1f} s" if plays and played else ""), f"{len(links) - len(broken)}/{len(links)}",
                         "ok" if ok else "FAIL", probe["height"]))
            for h in broken:
                print(f"{name}: link to a missing file: {h}", file=sys.stderr)
            for a in audio:
                if a not in playable:
                    print(f"{name}: audio not playable: {a}", file=sys.stderr)
            for broken in probe["imagesBroken"]:
                print(f"{name}: image not decoded: {broken}", file=sys.stderr)
            if shots is not None:
                shots.mkdir(parents=True, exist_ok=True)
                height = min(probe["height"], max_height)
                png = page.screenshot(full_page=True,
                                      clip=None if height == probe["height"] else
                                      {"x": 0, "y": 0, "width": WIDTH, "height": height})
                (shots / f"{name}.png").write_bytes(_shrink(png, colors))
            page.close()
        ctx.close()
    head = ("page", "scrollWidth", "images", "audio playable", "local links", "ok", "height")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print(" | ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
    if shots is not None:
        for name, *_ in rows:
            p = shots / f"{name}.png"
            print(f"screenshot {p} ({p.stat().st_size // 1024} KiB)")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pages", nargs="+", metavar="NAME=PATH", help="a name for the row and screenshot, and the page")
    ap.add_argument("--shots", type=Path, help="write NAME.png full-page screenshots here")
    ap.add_argument("--chromium", default="/usr/bin/chromium", help="the browser binary (default %(default)s)")
    ap.add_argument("--max-height", type=int, default=12000, help="clip screenshots to this many px")
    ap.add_argument("--colors", type=int, default=256, help="quantise screenshots to this many colours")
    args = ap.parse_args(argv)
    pages = []
    for spec in args.pages:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = Path(spec).stem, spec
        if not Path(path).is_file():
            ap.error(f"{path}: no such file")
        pages.append((name, Path(path)))
    return check(pages, args.shots, args.chromium, args.max_height, args.colors)


if __name__ == "__main__":
    sys.exit(main())
