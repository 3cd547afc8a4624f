"""`memalpha write`: a trained writer turns your conversations into memories (JSON)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from memalpha.errors import UserError

REGISTRY_SCHEMES = ("models:/", "runs:/")


def register(subparsers) -> None:
    parser = subparsers.add_parser("write", help="write the memory of conversations with a trained writer")
    parser.add_argument("--model", default="adapters/writer",
                        help="the writer: an adapter folder (default: the shipped adapters/writer), a run or checkpoint "
                             "folder, a downloaded model folder, or a registry URI (models:/NAME@ALIAS, with "
                             "MLFLOW_TRACKING_URI set)")
    parser.add_argument("--input", required=True,
                        help="a JSONL of turns ({speaker, text, date?} a line), a LoCoMo-format JSON, a JSON list of "
                             "{turns|chunks|text, questions?}, or plain text")
    parser.add_argument("--out", default="memory.json", help="where the memories go (JSON; default memory.json)")
    parser.add_argument("--batch-size", type=int, help="conversations written together (default: eval.batch_size)")
    parser.add_argument("--config", help="YAML config file (default: the one logged with a registry model, else the recipe)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. rollout.engine=llamacpp (the writer's `memalpha export` on "
                             "its llama.cpp server) or model.reader=qwen2.5-coder-1.5b")
    parser.set_defaults(handler=run)


def fetch_model(uri: str, dest: Path) -> Path:
    """A registry model downloaded through the MLflow CLI (this package does not import mlflow)."""
    done = subprocess.run([sys.executable, "-m", "mlflow", "artifacts", "download", "-u", uri, "-d", str(dest)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"--model {uri}: could not download it from MLflow ({(done.stderr or done.stdout).strip()[-400:]})")
    return dest


def run(args) -> int:
    from memalpha.config import load_config
    from memalpha.evaluation.methods import model_artifacts, resolve_adapter
    from memalpha.progress import WriteProgress
    from memalpha.writer import MemoryWriter, read_conversations

    conversations = read_conversations(args.input)
    with tempfile.TemporaryDirectory() as tmp:
        folder = fetch_model(args.model, Path(tmp) / "model") if args.model.startswith(REGISTRY_SCHEMES) else Path(args.model)
        artifacts = model_artifacts(folder) if (folder / "MLmodel").is_file() else {}
        if args.config or "config" not in artifacts:
            config = load_config(args.config, args.set)
        else:
            config = load_config(None, args.set, base=json.loads(artifacts["config"].read_text()))
        started = time.perf_counter()
        writer = MemoryWriter(resolve_adapter(folder), config, base_model=artifacts.get("base_model"))
        chunks = sum(len(writer.chunks(c)) for c in conversations)
        print(f"writer loaded in {time.perf_counter() - started:.1f} s (chunks of {writer.chunk_tokens} tokens); "
              f"{len(conversations)} conversation(s), {chunks} chunks", flush=True)
        with WriteProgress(chunks, lambda line: print(line, flush=True)) as progress:
            memories = writer.write(conversations, progress, args.batch_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(f".{out.name}.tmp")
    tmp_out.write_text(json.dumps(memories if len(memories) > 1 else memories[0], indent=1, ensure_ascii=False) + "\n")
    tmp_out.replace(out)
    entries = sum(len(m.get(k, [])) for m in memories for k in ("semantic", "episodic"))
    print(f"wrote {out}: {entries} entries in {time.perf_counter() - started:.0f} s")
    return 0
