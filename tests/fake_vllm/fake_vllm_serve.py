#!/usr/bin/env python3
"""Fake ``vllm`` executable: ``fake_vllm_serve.py serve MODEL --omni --host H --port N [args]``.

Speaks the part of vLLM-Omni 0.30.0's OpenAI server the harness uses: ``GET /health`` and
``POST /v1/chat/completions`` with ``modalities`` and ``sampling_params_list``, answering the Thinker
text in ``choices[0].message.content`` and a real base64 WAV in ``choices[0].message.audio.data``
(the merged choice of 0.30.0). Like vLLM it loads the ``vllm.general_plugins`` entry point
``omni_stress_trace`` and then imports ``vllm_omni.model_executor.models.qwen2_5_omni.qwen2_5_omni``
(a fake under ``pkgs/``), so the real trace plugin writes the trace; every request runs a scripted
Talker schedule through ``model.preprocess`` with the runner's metadata keys.

Scripted schedule per request (P = FAKE_VLLM_P, default 20; chunk 8): prefill (0,8) (8,8) (16,4),
decode (20,1)..(24,1), preemption, replay (0,8) (8,8) (16,8), decode (24,1) (25,1).
A ``profile-dummy`` request is traced once at start-up (unmatched by the harness).

Control by environment (comma lists name prompt ids, matched inside X-Request-Id):
FAKE_VLLM_ARGV_FILE (append argv+env as a JSON line), FAKE_VLLM_PIDFILE (write server and worker
pids), FAKE_VLLM_NEVER_HEALTHY=1, FAKE_VLLM_STARTUP_DELAY=s, FAKE_VLLM_DIE_AFTER=K (a traceback, then exit 3 after K
responses; with FAKE_VLLM_ENGINE_DEAD=1 the engine's and the API server's tracebacks and the server lives
on, answering every later request with HTTP 500), FAKE_VLLM_MALFORMED=ids, FAKE_VLLM_BAD_AUDIO=ids (not base64), FAKE_VLLM_NOT_WAV=ids,
FAKE_VLLM_FAIL_ONCE=ids (HTTP 500 on the first attempt), FAKE_VLLM_HANG=ids (never answer),
FAKE_VLLM_IGNORE=INT,TERM (ignore those signals), FAKE_VLLM_WORKER=1 (spawn a child that ignores
SIGINT, like a stage worker), FAKE_VLLM_P, FAKE_VLLM_DELAY=s (per-request base delay).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
import wave
from pathlib import Path

HERE = Path(__file__).resolve().parent
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_tokens", "seed", "repetition_penalty", "detokenize",
                 "stop_token_ids", "min_tokens"}


def _ids(name: str) -> list[str]:
    return [x for x in os.environ.get(name, "").split(",") if x]


def make_wav(seconds: float = 0.25, rate: int = 24000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        n = int(seconds * rate)
        w.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate))) for i in range(n)))
    return buf.getvalue()


def schedule(P: int) -> list[tuple[int, int]]:
    spans = [(0, 8), (8, 8), (16, P - 16)]
    spans += [(P + k, 1) for k in range(5)]
    spans += [(0, 8), (8, 8), (16, 8), (24, 1), (25, 1)]
    return spans


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="vllm")
    p.add_argument("subcommand", choices=["serve"])
    p.add_argument("model")
    p.add_argument("--omni", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--stage-overrides", default=None)
    p.add_argument("--async-chunk", action=argparse.BooleanOptionalAction, default=None)
    return p.parse_known_args(argv)


def validate_stage_overrides(value: str | None) -> None:
    """As vllm_omni/entrypoints/utils.py: parse_stage_overrides (0.30.0)."""
    if value is None:
        return
    parsed = json.loads(value)
    if not isinstance(parsed, dict):
        raise SystemExit("--stage-overrides must be a JSON object")
    for key, val in parsed.items():
        if not (isinstance(key, str) and key.isdigit()) or not isinstance(val, dict):
            raise SystemExit(f"--stage-overrides: bad entry {key!r}")


def main() -> None:
    args, extra = parse_args(sys.argv[1:])
    if not args.omni:
        raise SystemExit("fake vllm: --omni missing")
    validate_stage_overrides(args.stage_overrides)
    if os.environ.get("FAKE_VLLM_ARGV_FILE"):
        with open(os.environ["FAKE_VLLM_ARGV_FILE"], "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"argv": sys.argv[1:], "pid": os.getpid(),
                                 "OMNI_STRESS_TRACE": os.environ.get("OMNI_STRESS_TRACE")}) + "\n")
    for name in _ids("FAKE_VLLM_IGNORE"):
        signal.signal(getattr(signal, f"SIG{name}"), signal.SIG_IGN)
    worker = None
    if os.environ.get("FAKE_VLLM_WORKER"):
        worker = subprocess.Popen([sys.executable, "-c",
                                   "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)"])
    if os.environ.get("FAKE_VLLM_PIDFILE"):
        Path(os.environ["FAKE_VLLM_PIDFILE"]).write_text(
            json.dumps({"server": os.getpid(), "worker": worker.pid if worker else None}))

    # vLLM: load_general_plugins() -> our entry point; then the model module is imported and built.
    sys.path.insert(0, str(HERE / "pkgs"))
    from importlib.metadata import entry_points

    for ep in entry_points(group="vllm.general_plugins"):
        if ep.name == "omni_stress_trace":
            ep.load()()
    from vllm_omni.model_executor.models.qwen2_5_omni import qwen2_5_omni as talker_module

    model = talker_module.Qwen2_5OmniForConditionalGeneration(model_stage="talker")
    FakeTensor = talker_module.FakeTensor
    P = int(os.environ.get("FAKE_VLLM_P", "20"))
    model.preprocess(input_ids=FakeTensor(2, dim=0), input_embeds=None, request_id="profile-dummy",
                     _omni_prompt_len=2, _omni_num_computed_tokens=0, _omni_is_prefill=True)
    print(f"INFO fake vllm-omni serving {args.model} on {args.host}:{args.port}; extra={extra}", flush=True)
    time.sleep(float(os.environ.get("FAKE_VLLM_STARTUP_DELAY", "0.2")))
    asyncio.run(serve(args, model, FakeTensor, P))
    if worker is not None and worker.poll() is None:
        pass  # like a crashed parent: the worker is left to the launcher's group sweep


def _crash() -> None:
    """Dies as a crashed engine does: a traceback on stderr (vLLM's worker prefix on its lines), exit 3.
    FAKE_VLLM_COLOR=1: as vLLM writes it to a terminal (a coloured prefix, coloured logger headers) and
    with the API server's INFO line after the traceback."""
    color = os.environ.get("FAKE_VLLM_COLOR") == "1"
    prefix = (f"\x1b[1;36m(EngineCore_DP0 pid={os.getpid()})\x1b[0;0m " if color
              else f"(EngineCore_DP0 pid={os.getpid()}) ")
    if color:
        print(f"{prefix}\x1b[31mERROR\x1b[0m 12-06 05:21:00 [core.py:700] EngineCore encountered a fatal error.",
              file=sys.stderr)
    try:
        raise RuntimeError("talker preprocess: index 37 is out of bounds for dimension 0 with size 32 (fake crash)")
    except RuntimeError:
        import traceback

        for line in traceback.format_exc().splitlines():
            print(f"{prefix}{line}", file=sys.stderr)
    if color:
        print(f"\x1b[1;36m(APIServer pid={os.getpid()})\x1b[0;0m \x1b[32mINFO\x1b[0m 12-06 05:21:01 "
              "[launcher.py:99] Shutting down FastAPI HTTP server.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(3)


def _engine_died(dead: asyncio.Event) -> None:
    """FAKE_VLLM_ENGINE_DEAD=1: the engine core dies as 0.30.0's Qwen3-Omni Talker did on CPU, but the API
    server lives on: the worker's traceback, then the API server's ``EngineDeadError`` traceback; from then
    on every request is answered with an error (``dead``)."""
    import traceback

    worker = f"(StageEngineCoreProc_stage1_replica0 pid={os.getpid()}) ERROR 12-06 23:57:15 [stage_engine_core_proc.py:260] "
    api = f"(APIServer pid={os.getpid()}) ERROR 12-06 23:57:15 [stage_pool.py:1227] "
    for prefix, exc in ((worker, IndexError("index 7 is out of bounds for dimension 0 with size 6 (fake engine death)")),
                        (api, RuntimeError("EngineCore encountered an issue. See stack trace (above) for the root cause."))):
        try:
            raise exc
        except Exception:  # noqa: BLE001
            text = traceback.format_exc()
        if prefix is api:
            text = text.replace("RuntimeError:", "vllm.v1.engine.exceptions.EngineDeadError:")
        for line in text.splitlines():
            print(f"{prefix}{line}", file=sys.stderr)
    sys.stderr.flush()
    dead.set()


async def serve(args: argparse.Namespace, model, FakeTensor, P: int) -> None:
    from aiohttp import web

    wav = make_wav()
    state = {"arrivals": 0, "started": 0, "done": 0}
    failed_once: set[str] = set()
    die_after = int(os.environ.get("FAKE_VLLM_DIE_AFTER", "0") or 0)
    base_delay = float(os.environ.get("FAKE_VLLM_DELAY", "0.02"))
    stop = asyncio.Event()
    dead = asyncio.Event()  # FAKE_VLLM_ENGINE_DEAD: the engine died, the API server lives on

    async def health(_request: web.Request) -> web.Response:
        if os.environ.get("FAKE_VLLM_NEVER_HEALTHY"):
            return web.json_response({"status": "unhealthy", "reason": "No engine initialized"}, status=503)
        return web.json_response({"status": "healthy"})

    def error(msg: str, status: int = 400) -> web.Response:
        return web.json_response({"error": {"message": msg, "type": "BadRequestError", "code": status}}, status=status)

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        xid = request.headers.get("X-Request-Id") or body.get("request_id") or uuid.uuid4().hex
        if body.get("modalities") != ["text", "audio"]:
            return error(f"bad modalities {body.get('modalities')!r}")
        spl = body.get("sampling_params_list")
        if not isinstance(spl, list) or len(spl) != 3 or not all(isinstance(d, dict) for d in spl):
            return error("sampling_params_list must be 3 objects (Thinker, Talker, Code2Wav)")
        bad = sorted({k for d in spl for k in d} - SAMPLING_KEYS)
        if bad:
            return error(f"SamplingParams got unexpected keyword arguments {bad}")
        user = body["messages"][-1]["content"][0]["text"]
        once = [i for i in _ids("FAKE_VLLM_FAIL_ONCE") if i in xid and i not in failed_once]
        if once:
            failed_once.update(once)
            return error("EngineCore encountered an issue", status=500)
        if any(i in xid for i in _ids("FAKE_VLLM_HANG")):
            await asyncio.sleep(3600)
        index = state["arrivals"]
        state["arrivals"] += 1
        await asyncio.sleep(base_delay * (1 + index))
        engine_id = f"chatcmpl-{xid}-{uuid.uuid4().hex[:8]}"
        for c, n in schedule(P):
            model.preprocess(input_ids=FakeTensor(n, dim=0), input_embeds=None, request_id=engine_id,
                             _omni_prompt_len=P, _omni_num_computed_tokens=c, _omni_is_prefill=c < P,
                             _omni_max_tokens=spl[1].get("max_tokens"), _omni_seed=spl[1].get("seed"))
        if die_after and index >= die_after:  # by arrival order, so which requests it takes is not a race
            if os.environ.get("FAKE_VLLM_ENGINE_DEAD") == "1":
                await dead.wait()
                return error("EngineCore encountered an issue. See stack trace (above) for the root cause.", 500)
            await asyncio.sleep(3600)  # the server is about to die; this request never completes
        state["started"] += 1
        audio = base64.b64encode(wav).decode()
        if any(i in xid for i in _ids("FAKE_VLLM_BAD_AUDIO")):
            audio = "%%% not base64 %%%"
        if any(i in xid for i in _ids("FAKE_VLLM_NOT_WAV")):
            audio = base64.b64encode(b"RIFF0000WAVEjunk").decode()
        payload = {
            "id": f"chatcmpl-{xid}", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{
                "index": 0, "finish_reason": "stop", "logprobs": None,
                "message": {"role": "assistant", "content": f"You asked: {user}",
                            "audio": {"id": "audio-0", "data": audio, "expires_at": 0, "transcript": ""}},
            }],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        raw = json.dumps(payload).encode()
        if any(i in xid for i in _ids("FAKE_VLLM_MALFORMED")):
            raw = raw[: len(raw) // 2]
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(raw)
        await resp.prepare(request)
        await resp.write(raw)
        await resp.write_eof()
        state["done"] += 1
        if die_after and state["done"] == die_after:
            if os.environ.get("FAKE_VLLM_ENGINE_DEAD") == "1":
                asyncio.get_running_loop().call_later(0.3, _engine_died, dead)
            else:
                asyncio.get_running_loop().call_later(0.3, _crash)
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    loop = asyncio.get_running_loop()
    ignored = set(_ids("FAKE_VLLM_IGNORE"))
    for name in ("INT", "TERM"):
        if name not in ignored:
            loop.add_signal_handler(getattr(signal, f"SIG{name}"), stop.set)
    print("INFO Application startup complete.", flush=True)
    await stop.wait()
    await runner.cleanup()
    print("INFO shutdown complete", flush=True)


if __name__ == "__main__":
    main()
