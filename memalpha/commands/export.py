"""`memalpha export`: a trained writer into what llama.cpp runs: its base model's GGUF plus the LoRA as a GGUF
adapter (llama.cpp's own `convert_lora_to_gguf.py`), with a manifest naming both and the adapter's sha256.
`bash infra/servers.sh start-llama writer` then serves it; `rollout.engine=llamacpp` writes with it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from memalpha.errors import UserError


def register(subparsers) -> None:
    parser = subparsers.add_parser("export", help="export a trained writer to GGUF for llama.cpp")
    parser.add_argument("model", nargs="?", default="adapters/writer",
                        help="the writer: an adapter folder (default: the shipped adapters/writer), a run or checkpoint "
                             "folder, or a downloaded model folder")
    parser.add_argument("--out", help="export folder (default: <cache>/llama.cpp/writer, what the `writer` server serves)")
    parser.add_argument("--policy", help="the adapter's base model (default: a registered model's own, else model.policy of the defaults)")
    parser.set_defaults(handler=run)


def base_gguf(policy: str, hf_dir: str, out: Path) -> Path:
    """A GGUF of the base weights the adapter was trained on: the packaged GGUF the trainer's weights were
    dequantised from (the same weights), else the HF folder converted to bf16."""
    from memalpha.models.loading import PACKAGED_POLICIES, packaged_gguf

    if policy in PACKAGED_POLICIES:
        return packaged_gguf(policy)
    target = out / "base-bf16.gguf"
    convert("convert_hf_to_gguf.py", ["--outtype", "bf16", "--outfile", str(target), hf_dir])
    return target


def convert(script: str, args: list[str]) -> None:
    """Run one of llama.cpp's converters (built with it by `make llm`) on its own gguf-py."""
    from memalpha.models.llamacpp import LLAMA_CPP_VERSION
    from memalpha.models.loading import cache_dir

    home = cache_dir() / "llama.cpp" / LLAMA_CPP_VERSION
    if not (home / script).is_file():
        raise UserError(f"{home / script} is missing: build llama.cpp with `make llm`")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(home / "gguf-py"), str(home)]), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(home / script), *args], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise UserError(f"{script} failed: {(done.stderr or done.stdout).strip()[-600:]}")


def export(adapter: Path, out: Path, policy: str) -> dict:
    """Write <out>/writer-lora.gguf and <out>/export.json; returns the manifest."""
    from memalpha.models.llamacpp import EXPORT_MANIFEST, file_sha256
    from memalpha.models.loading import resolve_model_path

    started = time.perf_counter()
    hf_dir = resolve_model_path(policy)
    staged = out.with_name(out.name + ".tmp")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    # f32: the adapter's own precision; a LoRA of a small writer is a few MB
    convert("convert_lora_to_gguf.py", ["--base", hf_dir, "--outtype", "f32", "--outfile",
                                        str(staged / "writer-lora.gguf"), str(adapter)])
    manifest = {"policy": policy, "adapter": str(adapter.resolve()),
                "adapter_sha256": file_sha256(adapter / "adapter_model.safetensors"),
                "base_gguf": str(base_gguf(policy, hf_dir, staged)), "lora_gguf": "writer-lora.gguf"}
    manifest["base_gguf"] = manifest["base_gguf"].replace(str(staged), str(out))
    manifest["seconds"] = round(time.perf_counter() - started, 1)
    (staged / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    staged.rename(out)  # a cut-short export never replaces a served one half-written
    return manifest


def run(args) -> int:
    from memalpha.config import load_config
    from memalpha.evaluation.methods import MLMODEL, model_artifacts, resolve_adapter
    from memalpha.models.llamacpp import writer_dir

    adapter = resolve_adapter(args.model)
    out = Path(args.out) if args.out else writer_dir()
    policy = args.policy
    if policy is None and (config := model_artifacts(Path(args.model)).get("config") if (Path(args.model) / MLMODEL).is_file() else None):
        policy = json.loads(config.read_text())["model"]["policy"]  # a registered writer names its own base
    manifest = export(adapter, out, policy or load_config(None).model.policy)
    print(f"exported {adapter} to {out} in {manifest['seconds']} s (base {manifest['base_gguf']}, LoRA "
          f"{manifest['lora_gguf']}); serve it with `bash infra/servers.sh stop-llama writer; bash infra/servers.sh "
          "start-llama writer`")
    return 0
