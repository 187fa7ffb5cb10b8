"""``omni-stress conform --source``: every release. The vendored 0.30.0 and 0.32.0rc1 copies (hashes pinned
here) both check, offline; a version resolves to the installed distribution, a cached wheel, the vendored
copy or a pip download; wheels and trees read like the vendored copy."""

from __future__ import annotations

import hashlib
import json
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from harness.conform.check import check_model, modes_for, runners_for
from harness.conform.models import MODELS
from harness.conform.reach import expand_files, load_shipped
from harness.talkers.release import DEFAULT_SOURCES, VENDORED, deploy_names, resolve, split_source, vendor_dir
from harness.errors import UserError

torch.set_num_threads(1)
RC = "0.32.0rc1"
RC_WHEEL_SHA256 = "93d3990d21bbbfd6c5d23a47d965dfde7aa95c3e9ac4a34e6bca58bc80c7444b"
# every vendored 0.32.0rc1 file, as in the PyPI wheel (its RECORD agrees)
RC_FILES = {
    "vllm_omni/model_executor/models/fish_speech/fish_speech_slow_ar.py":
        "97c48ba57c5e5fac6975bc9a065838c5c7d6482dbdaaa44befede97c30f1b5c4",
    "vllm_omni/model_executor/models/fish_speech/prompt_utils.py":
        "b4eb8597dcb48b7617f952f724905a553c0ed2a346b65748bc3c22b76b61e997",
    "vllm_omni/model_executor/models/gepard/gepard_talker.py":
        "a931bfb26754ab6995d104f44f3d4607a462735a6f3102163b8dd468a5d7c013",
    "vllm_omni/model_executor/models/gepard/prompt.py":
        "ef6effc20f7d4e71cf205d11de72f2e1b2f226cfd669a7ed441dd2b7f2d773d4",
    "vllm_omni/deploy/fish_qwen3_omni.yaml":
        "b48ac3fbd2ac3e3a8b37d643595eceb867b1a7c95bf176cdcc82ca0d1fd3825a",
    "vllm_omni/deploy/fish_qwen3_omni_2gpu.yaml":
        "2f37919f02a7362ea7339b7374674c4b918d08b9af19fca7138ebcc5242ab1da",
    "vllm_omni/deploy/fish_qwen3_omni_high_concurrency_dual_gpu.yaml":
        "46336904b59fdc89c6afb28841b5ad108759b3a5e2058661b8cc57214bc8fa1c",
    "vllm_omni/deploy/fish_qwen3_omni_high_concurrency_single_gpu.yaml":
        "74af7323ebb7ad95ce7004e16bb55376ab96517376042fc244e02ff70e15b6ab",
    "vllm_omni/deploy/gepard.yaml":
        "361956ed9f78e8aa8704b2e1ccd71f4eabbf8a44d63bb72a6b708c5f451a09b4",
    "vllm_omni/model_executor/models/moss_tts/modeling_moss_tts_talker.py":
        "19e8ddde8f225ebd50f40c37daabc200dec6478cca4f7b912aa4d58e53d865a2",
    "vllm_omni/deploy/moss_tts.yaml":
        "d67c3dc4c43a3ed221fbd625d4e45f39360178fd551f9b9ea9324a551c7aca68",
    "vllm_omni/deploy/moss_tts_80gb.yaml":
        "857bc4c86fc3570b78913ce545633e9eee63d8aed4b6ad02bb20a14305976ade",
    "vllm_omni/deploy/moss_ttsd.yaml":
        "872bc25c1f49993268240ecbeaa18159dfb09ebcaf54afaea2ebd232616c9dea",
    "vllm_omni/deploy/moss_sound_effect.yaml":
        "e5a7a272da1e826811a5b6c01770a02352be6ed113987ab023279751ed8cc309",
    "vllm_omni/deploy/moss_voice_generator.yaml":
        "07360c0de89b4605b66023b14dd29ee7e40b349dbd337152d18b426033052888",
    "vllm_omni/model_executor/models/glm_tts/glm_tts.py":
        "8f072eb0f9ce21fcf6b77eefa57c8ab870b101dcc39dc82802d1c82c69a32aba",
    "vllm_omni/deploy/glm_tts.yaml":
        "8d0c5ffbb5fcc7ecd71ef125a2ee9dd778c037d45241d3e0ac6f4ac4bb9c4995",
    "LICENSE":
        "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4",
    "vllm_omni/_version.py":
        "83e114783c85767dfe7bd749af0cd0959e075c691e50e9d552b233577f5b865e",
    "vllm_omni/deploy/minicpmo_4_5.yaml":
        "83cfa6a425c741a29d7c54c9a61e4ab9bacbd227b2c7e8b33bf1455f079e77a5",
    "vllm_omni/deploy/minicpmo_4_5_2gpu.yaml":
        "579349f0a63fdcdab21ec3acfd0d0ffb0d99782df1a57ad4143ba579b3771004",
    "vllm_omni/deploy/minicpmo_4_5_3gpu.yaml":
        "5f2eae31f1758f335222a1f9f3f5b1284aaf30615d010d26dd778a689d72ddb7",
    "vllm_omni/deploy/minicpmo_4_5_3gpu_stage1_replicas.yaml":
        "b001dd3c994c28491d3db19dff2160ea2e3ac793010a7fe637485f145858adab",
    "vllm_omni/deploy/minicpmo_4_5_4gpu_stage1_replicas.yaml":
        "3cd3b027e53470103cf4219a3746928ff5e41cb7f81fc89afab78a6df66ad78f",
    "vllm_omni/deploy/minicpmo_4_5_8x4090.yaml":
        "8cb287325823b21b25ecdf23fe82cef417799e110ed6eb2f7074948e03a263d5",
    "vllm_omni/deploy/minicpmo_4_5_8x4090_stage1_replicas.yaml":
        "1a9cbfa46e6e4bf8183c7134e1a6e98a9b835574335e88e27242d2953d4c6cbd",
    "vllm_omni/deploy/minicpmo_4_5_duplex_h200.yaml":
        "29e2b615b0cac84eff38013e2e5663c3d191560eb2902bf923de449eb2668ad8",
    "vllm_omni/deploy/minicpmo_4_5_duplex_mrv2.yaml":
        "85165f918e9229270926d6ae40c99be014d5afd57a078a0fae41b3b4fc148810",
    "vllm_omni/deploy/minicpmo_4_5_stage2_replicas.yaml":
        "c2639d14068a30a0a2848f48a3b75051cded055d4f9a87f1dd8db94c80dbc1e4",
    "vllm_omni/deploy/minicpmo_4_5_turn.yaml":
        "f2d1353a031cdd709e9b401f2dc2266b8dd4c63c4fca613addaa1e6fd03c3bdd",
    "vllm_omni/deploy/minicpmo_4_5_turn_mrv2.yaml":
        "041fb29d1fd644b89926303f1ff44a2061837a1b9b2878d18005c691eb09a355",
    "vllm_omni/deploy/minicpmo_4_5_turn_mrv2_h200.yaml":
        "f1912fad54c5091ab5073c44c4c51650ec2bf24ead387e086d5e2d612e1f275c",
    "vllm_omni/deploy/qwen2_5_omni.yaml":
        "d251d8e66f80bdededeb5e6e6f8199a8c4f7c8ae79430ef67befbb0178946a6f",
    "vllm_omni/deploy/qwen3_omni_duplex.yaml":
        "75def35dbb839162f69c82172a4b658ccee2027767920d43454cc3a3f7750301",
    "vllm_omni/deploy/qwen3_omni_duplex_mrv2.yaml":
        "1cffd16d11258d1b6f2a2ea22c0dba8849e06dbafb2eb723c40ef685afab23c0",
    "vllm_omni/deploy/qwen3_omni_moe.yaml":
        "df882aa6ccc28a998dace784977b6d1dbf6c3225eb50b29f5aee2b9981ddd898",
    "vllm_omni/deploy/qwen3_omni_moe_mori_intranode.yaml":
        "6c7aa8eb6b21557442220d67b7983f98dd4f9e7b8a19a19f58fd7a3e3d537c96",
    "vllm_omni/deploy/qwen3_omni_moe_mrv2.yaml":
        "2287952a027d1df59c4fb7a6a19e9371653825294cfc6a6afc4703e684685e5a",
    "vllm_omni/deploy/qwen3_omni_moe_mrv2_h200.yaml":
        "e1fbd356470f71df3cc657c65b016369f798bd380ed24f87d738f3098da9be96",
    "vllm_omni/deploy/qwen3_omni_moe_thinking.yaml":
        "f0028e2f70e8bc8fb96be7fb3a1b4c706890cd3a0807910e653fb13173e777a3",
    "vllm_omni/deploy/qwen3_tts.yaml":
        "5a70f815a743f9814b55ebfa98094da1ffed58ef4eb73a3f8dbbf84879332649",
    "vllm_omni/deploy/qwen3_tts_forced_aligner.yaml":
        "465c69fe490c271ba72251ca5e8cb51c4b17fb81c54f748270f61f2882740f2c",
    "vllm_omni/deploy/qwen3_tts_fused_single_gpu.yaml":
        "7966b7e31bfc4b2d6695b8dff5c208ca1576a8a46d5787e97ed592ea81972df4",
    "vllm_omni/deploy/qwen3_tts_high_concurrency.yaml":
        "c3b56eae26451f3fc28619765dd6b3753f31b506ffdaeba23e45c996e0146030",
    "vllm_omni/deploy/qwen3_tts_high_concurrency_mrv2.yaml":
        "b858cc2eda6203f96e7106e12390f67b6d917845ae97acc05c54c14cf72b5181",
    "vllm_omni/deploy/qwen3_tts_high_concurrency_mrv2_b4.yaml":
        "aa90187d94b4f41d8fc351c2a2226a72cad5014624e53d829948bdbc83ca2627",
    "vllm_omni/deploy/qwen3_tts_high_concurrency_mrv2_single_gpu.yaml":
        "598cb98ea760af38d28538afdf739ddf07759764016645749692579eff628f34",
    "vllm_omni/deploy/qwen3_tts_mrv2.yaml":
        "8f38bc4df39a05beb96834467c53bfb923d80fe27796a19ff9c85b33193e5535",
    "vllm_omni/engine/duplex/intermediate.py":
        "a30635d05e058c1d18033df7cdc5915c57f03f1f9626e5b3281feddf6b6538c0",
    "vllm_omni/model_executor/models/minicpmo_4_5/minicpmo_4_5_omni_tts.py":
        "6ee35512ed40e8cbe815c13d4cd0abfb7d4b82ec53919fb386c82a5a89735b10",
    "vllm_omni/model_executor/models/qwen2_5_omni/qwen2_5_omni.py":
        "de8b86f60d04dcb2d610e0893afa265fbc8edf5b140af7602b87d6a881c5c51d",
    "vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py":
        "2acb3d57b90cb86d1673584f438fc187b1b2758a34c6e1e7eef99afabc0d801f",
    "vllm_omni/model_executor/models/qwen3_omni/tool_speech.py":
        "9b9ab8c38af297ab47c1bc23267622c1183842ba8883d3ae347c0f67b53d0533",
    "vllm_omni/model_executor/models/qwen3_tts/qwen3_tts_talker.py":
        "b6b0dbdd790643657af022843d37266b437068a18667239468640dde9072657c",
    "vllm_omni/model_executor/stage_input_processors/minicpmo_4_5_omni.py":
        "24dcabcde226953f7c1df6dce200290d922d960fa04aca59e5f2ec0eef01c924",
    "vllm_omni/model_executor/stage_input_processors/qwen3_omni.py":
        "f6e077a30999cfc87b8cb4af334d58c2dff205c52f934608aa912c1dabc60832",
}


def test_vendored_prerelease_files_are_pinned_and_listed() -> None:
    root = vendor_dir(RC)
    present = {p.relative_to(root).as_posix() for p in root.rglob("*")
               if p.is_file() and p.name != "README.md" and "__pycache__" not in p.parts}  # bytecode: not vendored
    assert present == set(RC_FILES)
    readme = (root / "README.md").read_text()
    assert RC_WHEEL_SHA256 in readme
    for name, sha in RC_FILES.items():
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == sha, name
        if name != "LICENSE":
            assert f"| `{name}` | `{sha}` |" in readme, name
    assert VENDORED == ("0.30.0", RC) and DEFAULT_SOURCES == ("vllm-omni:0.30.0", f"vllm-omni:{RC}")


@pytest.fixture()
def no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("OMNI_STRESS_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path


def test_a_version_resolves_to_the_cache_then_the_vendored_copy_then_pip(no_cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.talkers.release as rel

    rel._resolve.cache_clear()
    r = resolve(f"vllm-omni=={RC}")
    assert (r.kind, r.version, r.spec) == ("vendored", RC, str(vendor_dir(RC)))
    assert resolve("vllm-omni:0.30.0").kind == "vendored"
    # a cached wheel of that version comes first
    wheels = no_cache / "cache" / "wheels"
    wheels.mkdir(parents=True)
    wheel = _wheel(wheels / f"vllm_omni-{RC}-py3-none-any.whl", vendor_dir(RC))
    rel._resolve.cache_clear()
    assert (resolve(f"vllm-omni:{RC}").kind, resolve(f"vllm-omni:{RC}").spec) == ("wheel-cache", str(wheel))
    # neither: pip download into a temporary folder (here a stand-in pip), or an error offline
    calls: list[list[str]] = []

    def fake_pip(cmd: list[str], **_kw: Any) -> Any:
        calls.append(cmd)
        _wheel(Path(cmd[cmd.index("-d") + 1]) / "vllm_omni-0.31.0rc1-py3-none-any.whl", vendor_dir(RC))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(rel.subprocess, "run", fake_pip)
    rel._resolve.cache_clear()
    got = resolve("vllm-omni==0.31.0rc1")
    assert got.kind == "downloaded" and got.version == "0.31.0rc1" and Path(got.spec).is_file()
    assert "vllm-omni==0.31.0rc1" in calls[0] and "--no-deps" in calls[0]
    monkeypatch.setenv("OMNI_STRESS_OFFLINE", "1")
    rel._resolve.cache_clear()
    with pytest.raises(UserError, match="OMNI_STRESS_OFFLINE"):
        resolve("vllm-omni==0.29.0rc1")
    with pytest.raises(UserError, match="no such file or folder"):
        resolve("vllm-omni:no/such/tree")
    with pytest.raises(UserError, match="vllm-omni:SOURCE"):
        split_source("vllm_omni-0.30.0")  # neither vllm-omni:SOURCE nor vllm-omni==VERSION
    rel._resolve.cache_clear()


def test_deploy_globs_and_stage_runners_of_the_prerelease() -> None:
    spec = str(vendor_dir(RC))
    md = MODELS["qwen3-omni"]().deploys
    files = expand_files(md.files, spec)
    assert files[:3] == ["qwen3_omni_moe.yaml", "qwen3_omni_duplex.yaml", "qwen3_omni_moe_mori_intranode.yaml"]
    assert {"qwen3_omni_moe_mrv2.yaml", "qwen3_omni_duplex_mrv2.yaml", "qwen3_omni_moe_mrv2_h200.yaml"} <= set(files)
    shipped = load_shipped(md, spec)
    runner = {(t.deploy, t.platform): t.runner for t in shipped.targets}
    # stage 1's own model_runner v2 on CUDA; the platforms' model_runner v1 also covers that stage
    assert runner[("qwen3_omni_moe_mrv2.yaml", "cuda")] == "v2"
    assert runner[("qwen3_omni_moe_mrv2.yaml", "rocm")] == "v1"
    assert ("qwen3_omni_moe_mrv2.yaml", "npu") in runner and runner[("qwen3_omni_moe.yaml", "cuda")] == "v1"
    # qwen3_omni_moe_thinking.yaml has no Talker stage: no target
    assert "qwen3_omni_moe_thinking.yaml" in files and not any(t.deploy == "qwen3_omni_moe_thinking.yaml"
                                                                for t in shipped.targets)
    # Qwen3-Omni: V1 streamed (its deploys) and full payload (extra); MRV2 + async_chunk is not modelled
    assert modes_for(MODELS["qwen3-omni"](), spec) == [("v1", False), ("v1", True)]
    assert runners_for(MODELS["qwen3-omni"](), spec) == ("v1",)
    assert runners_for(MODELS["qwen3-omni"](), "0.30.0") == ("v1",)
    assert runners_for(MODELS["qwen3-tts"](), "0.30.0") == ("v1", "v2")
    assert "qwen3_tts_fused_single_gpu.yaml" in deploy_names(spec)


def _wheel(path: Path, tree: Path) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for p in sorted(tree.rglob("*")):
            if p.is_file() and p.name not in ("README.md", "LICENSE"):
                zf.writestr(p.relative_to(tree).as_posix(), p.read_bytes())
        version = path.name.split("-")[1]
        zf.writestr(f"vllm_omni-{version}.dist-info/METADATA", f"Name: vllm-omni\nVersion: {version}\n")
    return path


@pytest.mark.parametrize("model", ["qwen2.5-omni", "qwen3-omni", "qwen3-tts", "minicpmo-4.5", "glm-tts", "moss-tts",
                                   "fish-speech", "gepard"])
def test_each_model_checks_on_the_prerelease_as_wheel_and_tree(model: str, tmp_path: Path) -> None:
    """0.32.0rc1 changed what the hooks import (device copies, tool-call cuts, K-step state): the stand-ins
    follow, so every model checks, and a wheel of the same files gives the same row as the tree."""
    wheel = _wheel(tmp_path / f"vllm_omni-{RC}-py3-none-any.whl", vendor_dir(RC))
    rows = {}
    for spec in (str(vendor_dir(RC)), str(wheel)):
        r = check_model(MODELS[model](), spec, (), requests=1, forced_generated=24)
        assert r.error is None, r.error
        assert r.provenance is not None and RC in r.provenance.what
        rows[spec] = {k: c.summary for k, c in r.cells.items()}
    assert rows[str(vendor_dir(RC))] == rows[str(wheel)]


def test_the_default_cli_checks_both_releases(tmp_path: Path) -> None:
    from harness.cli import main as cli_main

    js = tmp_path / "m.json"
    out = CliRunner().invoke(cli_main, ["conform", "--deploy", "none", "--requests", "1", "--generated", "24",
                                        "--json", str(js)], catch_exceptions=False)
    assert out.exit_code == 1, out.output
    assert "vllm-omni:0.30.0 = vLLM-Omni 0.30.0 (vendored copy" in out.output
    assert f"vllm-omni:{RC} = vLLM-Omni {RC} (vendored copy" in out.output
    assert "could not check" not in out.output
    data = json.loads(js.read_text())
    assert data["exit_code"] == 1 and len(data["releases"]) == 2
    old, new = ([m["model"] for m in rel["models"]] for rel in data["releases"])
    assert old == ["qwen2.5-omni", "qwen3-omni", "qwen3-omni@async", "qwen3-tts", "qwen3-tts@mrv2", "minicpmo-4.5",
                   "glm-tts", "moss-tts", "fish-speech", "gepard"]
    # 0.32.0rc1 ships MRV2 deploys for MiniCPM-o's Talker: a row (Qwen3-Omni's MRV2 deploys stream: not modelled)
    assert new == ["qwen2.5-omni", "qwen3-omni", "qwen3-omni@async", "qwen3-tts", "qwen3-tts@mrv2", "minicpmo-4.5",
                   "minicpmo-4.5@mrv2", "glm-tts", "moss-tts", "fish-speech", "gepard"]
    # the calibration runs once, with the first release
    assert list(data["releases"][0]["calibration"]) == ["qwen2.5-omni:main", "qwen2.5-omni:pr"]
    assert data["releases"][1]["calibration"] == {}
    status = {rel["source"].split(" = ")[0]: {m["model"]: m["reach_status"] for m in rel["models"]}
              for rel in data["releases"]}
    assert status["vllm-omni:0.30.0"]["qwen3-tts"] == status[f"vllm-omni:{RC}"]["qwen3-tts"] == "shipped"


@pytest.mark.parametrize("release", VENDORED)
def test_glm_tts_hands_back_the_runners_rows_and_conforms(release: str) -> None:
    """GLM-TTS (upstream #5018's list) is SupportsMultiModal: V1 embeds the span first and the hook returns
    those rows in the model's dtype for every prefill span, tail and decode step, so every schedule conforms;
    the one shipped deploy runs one sequence with a 512-token budget (chunking reachable, no preemption)."""
    r = check_model(MODELS["glm-tts"](), release, (), requests=1, forced_generated=24)
    assert r.error is None and r.status == "conforms", {k: c.detail for k, c in r.cells.items()}
    assert r.restart_verdict == "no restart after a preemption"
    targets = load_shipped(MODELS["glm-tts"]().deploys, release).targets
    assert [(t.deploy, t.platform, t.max_num_seqs, t.budget) for t in targets] == [("glm_tts.yaml", "cuda", 1, 512)]


@pytest.mark.parametrize("release", VENDORED)
def test_moss_tts_loses_its_reference_audio_on_a_replay_and_a_tail(release: str) -> None:
    """MOSS-TTS (upstream #5018's list): the reference-audio codes are sliced at ``ref_offset``, a counter the
    prefill advances by each span and a replay never resets, so a replayed prompt gets text rows only; a
    one-token prefill tail takes the decode branch (the previous frame's audio); chunks conform."""
    r = check_model(MODELS["moss-tts"](), release, (), requests=1, forced_generated=24)
    assert r.error is None
    P = r.cells["tail"].first.P
    assert r.cells["chunk"].status == "conforms"
    assert (r.cells["tail"].first.position, r.cells["tail"].first.got) == (P - 1, "the reference row of position "
                                                                                   f"{P - 2}")
    f = r.cells["cross_replay"].first
    assert (f.position, f.c, f.got) == (0, 0, "the bare embedding of its own id")
    assert r.verdict.startswith("fails under shipped deploy moss_tts.yaml (cuda, rocm), moss_tts_80gb.yaml (cuda)")
