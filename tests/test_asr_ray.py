"""Scoring on Ray actors (issue 34): ``--executor ray`` transcribes on Whisper actors.

Each test starts a one-machine Ray on 127.0.0.1 of its own (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
keeps Ray on the loopback address; ``RAY_TMPDIR`` a fresh folder, so its processes can be told
from any other Ray on the machine; ``RAY_AUTH_MODE=disabled``, so no token file is left in
``~/.ray``) and checks that none of its processes is left afterwards.

* the actor pool: one model load per actor, clips spread over both actors, the per-clip and the
  batched transcripts exactly as in this process;
* the CLI: ``--executor ray`` (no ``--ray-address``: the run starts and stops its own Ray) records
  the same transcripts and WERs as a local run, with ``--asr-batch 2``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import REPO, SMALL_PROMPTS

from harness.records import read_manifest

pytestmark = pytest.mark.slow

PY = sys.executable
SENTENCES = [
    "Keep your room dark, quiet and cool.",
    "Mix four cups of flour with a spoon of salt.",
    "Plan to stop every two hours to stretch and change drivers.",
]
PER_CLIP = ["Keep your room dark, quiet and cool.", "Mix 4 cups on flour with a spoon and salt",
            "Plan to stop every two hours to stretch and change drivers.", ""]
BATCHED = ["Keep your room dark, quiet and cool.", "Mix 4 cups on flour with a spoon unsalted",
           "Plan to stop every two hours to stretch and change drivers.", ""]


def _ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


needs_ray = pytest.mark.skipif(not _ray_installed(), reason="ray not installed (pip install omni-stress[ray])")


@pytest.fixture
def ray_env():
    """The environment of a process that starts a Ray of its own on 127.0.0.1 under a fresh RAY_TMPDIR;
    afterwards, no process of that Ray may be left."""
    temp = Path(tempfile.mkdtemp(prefix="osr-", dir="/tmp"))  # short: Ray's socket paths live under it
    # RAY_AUTH_MODE=disabled: a local ray.init() would otherwise write ~/.ray/auth_token, and a token
    # there turns on token auth for every later `ray start` (tests/test_ray_executor.py's clusters).
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": str(temp),
           "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    try:
        yield env
        deadline = time.monotonic() + 60
        while _processes_under(temp) and time.monotonic() < deadline:
            time.sleep(0.5)  # a bounded wait for processes already told to exit, not a race
        assert _processes_under(temp) == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _processes_under(temp: Path) -> list[str]:
    """Live processes whose command line or open session names ``temp`` (Ray's GCS, raylet, workers)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state != "Z" and (str(temp) in cmd or f"RAY_TMPDIR={temp}".encode() in environ) and int(pid) != os.getpid():
            found.append(f"{pid} {cmd[:120]}")
    return found


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    from harness.audio.tts import PAUSE, speak, units_from_text

    folder = tmp_path_factory.mktemp("rayclips")
    out = []
    for i, text in enumerate(SENTENCES):
        out.append(folder / f"s{i}.wav")
        speak(units_from_text(text), out[-1])
    out.append(folder / "silence.wav")
    speak([PAUSE] * 8, out[-1])
    return out


ACTOR_SCRIPT = """
import json, sys
from concurrent.futures import FIRST_COMPLETED, wait
from pathlib import Path
from harness.audio.pool import PoolSpec
from harness.backends import RunOptions
from harness.executors import ray as rayexec

rayexec.connect(None)  # a one-machine Ray for this process, as a run without --ray-address starts one
import ray
out = {"ip": [n["NodeManagerAddress"] for n in ray.nodes()]}
wavs = [Path(p) for p in sys.argv[1:]]
for batch in (0, 2):
    spec = PoolSpec("faster-whisper", "tiny.en", 1, workers=2, threads_per_worker=1, batch=batch)
    pool = rayexec.RayAsrPool(spec, RunOptions(executor="ray", asr_workers=2))
    futs = [pool.submit(f"d{i}", w)[0] for i, w in enumerate(wavs)]
    while not all(f.done() for f in futs):
        pool.pump()
        wait([f for f in futs if not f.done()], timeout=600, return_when=FIRST_COMPLETED)
    out[batch] = {"texts": [f.result()[0] for f in futs], "stats": pool.actor_stats(), "batches": pool.batches}
    pool.close()
ray.shutdown()
print(json.dumps(out))
"""


@needs_ray
def test_actors_load_the_model_once_and_transcribe_as_this_process(ray_env, clips):
    res = subprocess.run([PY, "-c", ACTOR_SCRIPT, *map(str, clips)], cwd=REPO, env=ray_env, capture_output=True,
                         text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["ip"] == ["127.0.0.1"]
    for batch, want in (("0", PER_CLIP), ("2", BATCHED)):
        got = out[batch]
        assert got["texts"] == want, batch
        stats = got["stats"]
        assert len(stats) == 2 and len({s["pid"] for s in stats}) == 2
        assert [s["loads"] for s in stats] == [1, 1]  # one model load per actor, however many calls
        assert sum(s["clips"] for s in stats) == len(clips) and all(s["clips"] > 0 for s in stats)
        assert sum(got["batches"]) == len(clips)
        assert max(got["batches"]) == (1 if batch == "0" else 2)
    assert out["0"]["batches"] == [1, 1, 1, 1]  # per clip: a call per clip, two in flight per actor


def _run(env: dict, out: Path, run_id: str, *extra: str) -> Path:
    args = ["run", "--arm", "main", "--deploy", "reference", "--deploy", "stress", "--prompts", str(SMALL_PROMPTS),
            "--asr-model", "tiny.en", "--no-cache", "--quiet", "--out", str(out), "--run-id", run_id, *extra]
    res = subprocess.run([PY, "-m", "harness.cli", *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return out / run_id


def _scored(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    return sorted((r["arm"], r["deploy"], r["repeat"], r["prompt_id"], r["transcript"], r["wer"], r["asr_cached"])
                  for r in rows)


@needs_ray
def test_a_ray_run_scores_on_actors_like_a_local_run(ray_env, tmp_path):
    local_env = {k: v for k, v in ray_env.items() if not k.startswith("RAY_")}
    # The batched path only: it carries --asr-batch from the command line to the actors, which the
    # per-clip path (the default) does not need; both modes' transcripts on actors are compared with
    # this process's in test_actors_load_the_model_once_and_transcribe_as_this_process (issue 48: the
    # per-clip pair of runs was 2 minutes of CI on 2 cores).
    for batch in ("2",):
        local = _run(local_env, tmp_path, f"local{batch}", "--asr-workers", "2", "--asr-batch", batch)
        on_ray = _run(ray_env, tmp_path, f"ray{batch}", "--executor", "ray", "--asr-workers", "2", "--asr-batch", batch)
        assert _scored(on_ray) == _scored(local)
        assert len(_scored(local)) == 8 and sum(r[6] for r in _scored(local)) == 0  # 8 distinct clips transcribed
        manifest = read_manifest(on_ray)
        assert manifest["asr"] == {"backend": "faster-whisper", "model": "tiny.en", "beam_size": 1,
                                   **({"batch": 2} if batch == "2" else {})}
        assert {c["node"]["ip"] for c in manifest["cells"]} == {"127.0.0.1"}
