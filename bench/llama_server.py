"""A llama.cpp server for a benchmark or a test, started and stopped by the infra script users run
(`bash infra/servers.sh start-llama NAME`), its ports shifted by MEMALPHA_LLAMA_PORT_OFFSET and its PID file
and log in its own folder. Inside the block the offset is set in this process too, so clients find it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVERS = REPO / "infra" / "servers.sh"
OFFSET = "MEMALPHA_LLAMA_PORT_OFFSET"


def installed() -> bool:
    from memalpha.models.llamacpp import LLAMA_CPP_VERSION
    from memalpha.models.loading import cache_dir

    return (cache_dir() / "llama.cpp" / LLAMA_CPP_VERSION / "bin" / "llama-server").is_file()


def _servers(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SERVERS), *args], env=env, capture_output=True, text=True, timeout=600)


@contextmanager
def local_llama_server(state: Path, name: str, offset: int = 100, **extra_env: str) -> Iterator[dict]:
    """Yields {"url", "pid", "log", "env"}; the server is stopped on exit, whatever happened."""
    from memalpha.models.llamacpp import server_url

    state.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MEMALPHA_STATE": str(state), OFFSET: str(offset), **extra_env}
    previous = os.environ.get(OFFSET)
    os.environ[OFFSET] = str(offset)
    try:
        started = _servers("start-llama", name, env=env)
        if started.returncode != 0:
            raise RuntimeError(f"infra/servers.sh start-llama {name} failed:\n{started.stdout}\n{started.stderr}")
        yield {"url": server_url(name), "pid": int((state / f"llama-{name}.pid").read_text()),
               "log": state / f"llama-{name}.log", "env": env}
    finally:
        _servers("stop-llama", name, env=env)
        if previous is None:
            os.environ.pop(OFFSET, None)
        else:
            os.environ[OFFSET] = previous
