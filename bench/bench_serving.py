"""Serving benchmark of record: the shipped writer registered as the memory-writer pyfunc and served by the
real `mlflow models serve` process on 127.0.0.1 (the recipe's config), writing on the hf engine and on llama.cpp
(its GGUF export on a llama-server, where `make llm` built one).

- latency of one request, p50/p95 over `REPEATS` requests: 10 turns, and a whole LoCoMo session;
- throughput: `CLIENTS` concurrent clients, `PER_CLIENT` requests each (10 turns), requests/s, errors;
- writing speed side by side, in one process on one loaded policy: the whole session written as today's
  `write_memory` was called with it (one chunk per turn) against `MemoryWriter` (turns packed into the
  writer's 512-token chunks, the chunking it was trained on).

Uses LoCoMo's first session (data/raw/locomo10.json, `MEMALPHA_LOCOMO`) when present, else a generated
dialogue of the same length. Run it alone: every number here is CPU time.

    python -m bench.run_all serving
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOCOMO = Path(os.environ.get("MEMALPHA_LOCOMO", ROOT / "data" / "raw" / "locomo10.json"))
REPEATS = int(os.environ.get("MEMALPHA_BENCH_SERVING_REPEATS", "3"))
CLIENTS = 8
PER_CLIENT = 2


def session_turns() -> tuple[list[dict[str, str]], str]:
    """The turns of one real session (LoCoMo conv-26 session 1) and where they came from."""
    if LOCOMO.is_file():
        conv = json.loads(LOCOMO.read_text())[0]["conversation"]
        date = conv["session_1_date_time"]
        return [{"speaker": t["speaker"], "text": t["text"], "date": date} for t in conv["session_1"]], f"{LOCOMO.name}, conv-26 session 1"
    turns = [{"speaker": "Ana" if i % 2 else "Ben", "text": f"Turn {i}: I went to the market on day {i} and bought {i} apples.",
              "date": "1:00 pm on 8 May, 2023"} for i in range(18)]
    return turns, "generated dialogue (LoCoMo file absent)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, payload: dict) -> tuple[int, float]:
    body = json.dumps(payload).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body, headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=1800) as response:
            response.read()
            return response.status, time.perf_counter() - started
    except urllib.error.HTTPError as exc:
        return exc.code, time.perf_counter() - started
    except OSError:
        return 0, time.perf_counter() - started


def _percentiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {"p50_s": round(statistics.median(ordered), 2),
            "p95_s": round(ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], 2), "n": len(ordered)}


def register(tmp: Path) -> str:
    """The shipped writer logged as the pyfunc into a fresh store in `tmp`, aliased champion; the store URI."""
    import mlflow

    from memalpha.config import RunConfig
    from memalpha.models.loading import default_model_dir
    from memalpha.teacher.record import WRITER
    from serving.registry import log_writer_model

    uri = f"sqlite:///{tmp}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    run = client.create_run(client.create_experiment("serving-bench", artifact_location=str(tmp / "artifacts")))
    info = log_writer_model(run.info.run_id, WRITER, default_model_dir(), RunConfig().model_dump(mode="json"), "writer")
    client.set_registered_model_alias("writer", "champion", str(info.registered_model_version))
    return uri


def side_by_side(turns: list[dict[str, str]]) -> dict[str, Any]:
    """The session written one chunk per turn (today's `write_memory` called with the turns) and by
    `MemoryWriter` (packed chunks), on one loaded policy."""
    from memalpha.data.chunking import Turn
    from memalpha.data.schema import Instance
    from memalpha.teacher.record import WRITER
    from memalpha.training.rollout import write_unasked
    from memalpha.writer import Conversation, MemoryWriter

    writer = MemoryWriter(WRITER)
    lines = [f"{t['speaker']}: {t['text']}" for t in turns]
    started = time.perf_counter()
    [(written, _)] = list(write_unasked(writer.policy, [Instance("turns", "user", "accurate_retrieval", lines, [])],
                                       writer.config, batch_size=1))
    per_turn_s = time.perf_counter() - started
    conversation = Conversation("session", turns=[Turn(t["text"], t["speaker"], t["date"]) for t in turns])
    started = time.perf_counter()
    [packed] = writer.write([conversation])
    packed_s = time.perf_counter() - started
    return {"turns": len(turns), "one_chunk_per_turn": {"writer_calls": len(lines), "seconds": round(per_turn_s, 1),
                                                        "entries": sum(len(written[0].memory.entries(s)) for s in ("semantic", "episodic"))},
            "packed": {"writer_calls": packed["chunks"], "seconds": round(packed_s, 1),
                       "entries": len(packed["semantic"]) + len(packed["episodic"])},
            "speedup": round(per_turn_s / packed_s, 2)}


def measure(uri: str, tmp: Path, turns: list[dict[str, str]], engine: str) -> dict[str, Any]:
    """Latency and throughput of the registered writer behind `mlflow models serve`, writing on `engine`."""
    results: dict[str, Any] = {}
    port = _free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT": "1800",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "MEMALPHA_WRITER_ENGINE": engine}
    log = open(tmp / f"serve-{engine}.log", "w")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/writer@champion",
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "--workers", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.perf_counter() - started > 600:
                    raise RuntimeError("mlflow models serve did not start: " + (tmp / f"serve-{engine}.log").read_text()[-2000:])
                time.sleep(1)
        results["server_start_s"] = round(time.perf_counter() - started, 1)
        ten = {"inputs": [{"id": "ten", "turns": turns[:10]}]}
        whole = {"inputs": [{"id": "session", "turns": turns}]}
        for name, payload in (("ten_turns", ten), ("session", whole)):
            answered = [_post(port, payload) for _ in range(REPEATS)]
            results[f"latency_{name}"] = {**_percentiles([s for _, s in answered]),
                                          "errors": sum(code != 200 for code, _ in answered)}
            print(f"{engine} latency {name}: {results[f'latency_{name}']}", flush=True)
        began = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            answered = [r for rs in pool.map(lambda k: [_post(port, ten) for _ in range(PER_CLIENT)], range(CLIENTS)) for r in rs]
        wall = time.perf_counter() - began
        results["throughput"] = {"requests": len(answered), "seconds": round(wall, 1),
                                 "requests_per_s": round(len(answered) / wall, 3),
                                 "errors": sum(code != 200 for code, _ in answered),
                                 **{f"latency_{k}": v for k, v in _percentiles([s for _, s in answered]).items() if k != "n"}}
        print(f"{engine} throughput: {results['throughput']}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    return results


def run() -> dict[str, Any]:
    from bench.llama_server import installed, local_llama_server
    from memalpha.commands.export import export
    from memalpha.teacher.record import WRITER

    turns, source = session_turns()
    results: dict[str, Any] = {"input": source, "session_turns": len(turns), "clients": CLIENTS,
                               "requests_per_client": PER_CLIENT}
    if os.environ.get("MEMALPHA_BENCH_SERVING_PART") == "engines":  # the side-by-side kept from the last run
        results["writing_side_by_side"] = json.loads((ROOT / "bench" / "results" / "serving.json").read_text())["results"]["writing_side_by_side"]
    else:
        results["writing_side_by_side"] = side_by_side(turns)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        uri = register(tmp)
        results["engines"] = {"hf": measure(uri, tmp, turns, "hf")}
        if installed():  # the same writer exported to GGUF, on a llama.cpp server (`make llm`)
            exported = export(Path(WRITER), tmp / "export", "smollm2-135m-instruct")
            os.environ["MEMALPHA_LLAMA_WRITER"] = str(tmp / "export")
            try:
                with local_llama_server(tmp / "llama", "writer"):
                    results["engines"]["llamacpp"] = {**measure(uri, tmp, turns, "llamacpp"), "export_s": exported["seconds"]}
            finally:
                del os.environ["MEMALPHA_LLAMA_WRITER"]
    return results


def to_markdown(r: dict[str, Any]) -> str:
    s = r["writing_side_by_side"]
    lines = ["# Benchmark: serving the memory writer", "",
             "The shipped writer (adapters/writer) as the memory-writer pyfunc behind `mlflow models serve --env-manager local` "
             "on 127.0.0.1, greedy, on two engines: `hf` (the policy in the server's process) and `llamacpp` (its GGUF "
             "export, `memalpha export`, on a llama-server with 4 slots; `make serve ENGINE=llamacpp`). "
             f"Input: {r['input']} ({r['session_turns']} turns).", "",
             "| engine | request | p50 s | p95 s | requests | errors |", "|---|---|---|---|---|---|"]
    for engine, e in r["engines"].items():
        for name in ("ten_turns", "session"):
            m = e[f"latency_{name}"]
            lines.append(f"| {engine} | {name.replace('_', ' ')} (alone) | {m['p50_s']} | {m['p95_s']} | {m['n']} | {m['errors']} |")
        t = e["throughput"]
        lines.append(f"| {engine} | ten turns, {r['clients']} concurrent clients x {r['requests_per_client']} | {t['latency_p50_s']} | "
                     f"{t['latency_p95_s']} | {t['requests']} | {t['errors']} |")
    lines.append("")
    for engine, e in r["engines"].items():
        t = e["throughput"]
        lines.append(f"- {engine}: server start {e['server_start_s']} s; {r['clients']} concurrent clients: {t['requests_per_s']} "
                     f"requests/s ({t['requests']} requests in {t['seconds']} s; concurrent requests are written together).")
    lines += ["", "## Writing one session, side by side (hf, one process, one loaded policy)", "",
              "| how | writer calls | seconds | entries |", "|---|---|---|---|",
              f"| one chunk per turn (today's `write_memory` called with the turns) | {s['one_chunk_per_turn']['writer_calls']} | "
              f"{s['one_chunk_per_turn']['seconds']} | {s['one_chunk_per_turn']['entries']} |",
              f"| `MemoryWriter` / `memalpha write` (turns packed into 512-token chunks) | {s['packed']['writer_calls']} | "
              f"{s['packed']['seconds']} | {s['packed']['entries']} |", "",
              f"Speed-up: {s['speedup']}x."]
    return "\n".join(lines) + "\n"
