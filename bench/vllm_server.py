"""A vLLM server for a benchmark or a test, started and stopped by the infra script users run
(`bash infra/servers.sh start-vllm`), on a free port with its PID file and log in its own folder."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SERVERS = REPO / "infra" / "servers.sh"


def installed() -> bool:
    return VLLM_PYTHON.is_file()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _servers(command: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SERVERS), command], env=env, capture_output=True, text=True, timeout=600)


@contextmanager
def local_vllm_server(state: Path, *, model: str, dtype: str) -> Iterator[dict]:
    """Yields {"url", "pid", "log", "env"}; the server is stopped on exit, whatever happened."""
    state.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "MEMALPHA_STATE": str(state), "MEMALPHA_VLLM_PORT": str(port),
           "MEMALPHA_VLLM_MODEL": model, "MEMALPHA_VLLM_DTYPE": dtype}
    started = _servers("start-vllm", env)
    try:
        if started.returncode != 0:
            raise RuntimeError(f"infra/servers.sh start-vllm failed:\n{started.stdout}\n{started.stderr}")
        yield {"url": f"http://127.0.0.1:{port}", "pid": int((state / "vllm.pid").read_text()),
               "log": state / "vllm.log", "env": env}
    finally:
        _servers("stop-vllm", env)
