"""The memory writer as an MLflow pyfunc: logged and registered like grpo/train does, loaded back, and served
by the real `mlflow models serve` process on 127.0.0.1 (the tiny policy, so a request takes a second)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from memalpha.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONVERSATION = {"id": "maya", "turns": [
    {"speaker": "Maya", "text": "I moved to Lisbon last week.", "date": "1:00 pm on 8 May, 2023"},
    {"speaker": "Maya", "text": "I work at a bakery now.", "date": "1:00 pm on 8 May, 2023"}],
    "questions": ["Where does Maya work?"]}


@pytest.fixture(scope="module")
def registered(tmp_path_factory):
    """A tiny writer logged and registered as version 1 of `writer`, aliased champion; (tracking URI, tmp)."""
    import mlflow

    from memalpha.models.policy import load_policy
    from memalpha.teacher.record import with_writer_record
    from serving.registry import log_writer_model

    tmp = tmp_path_factory.mktemp("serving")
    config = load_config(ROOT / "configs" / "tiny.yaml")
    policy = load_policy(config.model, seed=0)
    policy.save_adapter(tmp / "adapter")
    policy.model.get_base_model().save_pretrained(tmp / "base")
    policy.tokenizer.save_pretrained(tmp / "base")
    uri = f"sqlite:///{tmp}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    experiment = client.create_experiment("serving", artifact_location=str(tmp / "artifacts"))
    run = client.create_run(experiment)
    adapter = with_writer_record(tmp / "adapter", tmp / "registered-adapter", config)
    info = log_writer_model(run.info.run_id, adapter, tmp / "base", config.model_dump(mode="json"), "writer")
    client.set_registered_model_alias("writer", "champion", str(info.registered_model_version))
    yield uri, tmp
    mlflow.set_tracking_uri(None)


def test_pyfunc_writes_a_memory_and_answers_and_names_bad_fields(registered):
    import mlflow
    from mlflow.exceptions import MlflowException

    uri, tmp = registered
    mlflow.set_tracking_uri(uri)
    model = mlflow.pyfunc.load_model("models:/writer@champion")
    assert "inputs" in str(model.metadata.get_input_schema()) or model.metadata.signature is not None
    [memory] = model.predict([CONVERSATION])
    assert set(memory) >= {"id", "core", "semantic", "episodic", "chunks", "answers"}
    assert memory["id"] == "maya" and memory["chunks"] == 1 and len(memory["answers"]) == 1
    second = model.predict([CONVERSATION, {"chunks": ["Ben: I have a dog named Rex."]}])
    assert [m["id"] for m in second] == ["maya", "inputs[1]"] and "answers" not in second[1]
    for bad, message in [({"turns": [{"speaker": "Maya"}]}, r"inputs\[0\].turns\[0\]: missing field 'text'"),
                         ({"turns": [{"speaker": "Maya", "text": 7}]}, r"turns\[0\].text: expected a string, got int"),
                         ({"turns": []}, r"inputs\[0\]: the conversation is empty")]:
        with pytest.raises(MlflowException, match=message):
            model.predict([bad])
    downloaded = Path(mlflow.artifacts.download_artifacts("models:/writer@champion", dst_path=str(tmp / "download")))
    record = json.loads((downloaded / "artifacts" / "registered-adapter" / "record.json").read_text())
    assert record["chunk_tokens"] == 512 and record["max_prompt_tokens"] == 1024


MARKER = "PRIVATE-7f3a"
"""Stands for user data in the bad requests: it must come back in no response and go into no log."""


def _big_bad_requests() -> list[tuple[bytes, str]]:
    """Bad request bodies of about 3 MB (one of 2 MB, to reach the field check under the size limit), each with
    the message its answer must carry: rejected by the pyfunc, by MLflow's type-hint check, by the JSON parser."""
    pad = MARKER * (3_000_000 // len(MARKER))
    return [(body if isinstance(body, bytes) else body.encode(), message) for body, message in [
        (json.dumps({"inputs": [{"turns": [{"speaker": "Maya", "text": pad[:1_900_000]}, {"speaker": "Maya"}]}]}),
         "inputs[0].turns[1]: missing field 'text'"),
        (json.dumps({"inputs": [{"turns": [{"speaker": "Maya", "text": pad}, {"speaker": "Maya"}]}]}),
         "more than the 2,000,000"),
        (json.dumps({"inputs": [[pad]]}), "Failed to validate data against type hint"),
        ('{"inputs": [{"text": "' + pad, "valid JSON"),
        (b"\xff" + pad.encode(), "UnicodeDecodeError"),  # not UTF-8
    ]]


def test_a_bad_request_of_3_mb_is_answered_with_the_message_alone_and_no_body_is_logged(registered, caplog, capfd,
                                                                                       monkeypatch):
    import logging

    import mlflow
    from fastapi.testclient import TestClient
    from mlflow.pyfunc import scoring_server

    uri, _ = registered
    mlflow.set_tracking_uri(uri)
    monkeypatch.setenv("_MLFLOW_IS_IN_SERVING_ENVIRONMENT", "false")  # init() sets it: undone after the test
    model = mlflow.pyfunc.load_model("models:/writer@champion")
    app = scoring_server.init(model)  # the app `mlflow models serve` runs
    caplog.set_level(logging.DEBUG)
    with TestClient(app) as client:
        for body, message in _big_bad_requests():
            response = client.post("/invocations", content=body, headers={"Content-Type": "application/json"})
            assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
            assert len(response.content) <= 2048 and MARKER not in response.text, response.text[:500]
            assert message in response.json()["message"], response.text
        out, err = capfd.readouterr()
        assert MARKER not in caplog.text + out + err

        def broken_writer(conversations):
            raise RuntimeError("the writer broke")

        # an unexpected error: its traceback goes to the log, not to the client
        monkeypatch.setattr(model.unwrap_python_model(), "batcher", broken_writer)
        response = client.post("/invocations", json={"inputs": [CONVERSATION]})
        assert response.status_code == 400 and "stack_trace" not in response.json(), response.text[:500]
        assert "RuntimeError: the writer broke" in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, body: bytes, timeout: float = 120) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture(scope="module")
def server(registered):
    uri, tmp = registered
    port = _free_port()
    # the scoring server execs `uvicorn` from PATH: the environment's bin folder first
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "models", "serve", "-m", "models:/writer@champion",
                             "--env-manager", "local", "-h", "127.0.0.1", "-p", str(port), "--workers", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2):
                break
        except OSError:
            assert proc.poll() is None, (tmp / "serve.log").read_text()[-3000:]
            time.sleep(1)
    else:
        pytest.fail("mlflow models serve did not answer /ping: " + (tmp / "serve.log").read_text()[-3000:])
    yield port
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_serving_answers_a_conversation_with_a_memory_and_refuses_bad_requests_without_dying(server, registered):
    status, body = _post(server, json.dumps({"inputs": [CONVERSATION]}).encode())
    assert status == 200, body
    [memory] = json.loads(body)["predictions"]
    assert memory["id"] == "maya" and {"core", "semantic", "episodic", "answers"} <= set(memory)
    bad_requests = [
        (json.dumps({"inputs": [{"turns": [{"speaker": "Maya"}]}]}), "missing field 'text'"),
        (json.dumps({"inputs": [{"turns": [{"speaker": "Maya", "text": ["not", "a", "string"]}]}]}), "expected a string"),
        (json.dumps({"inputs": [{"turns": []}]}), "the conversation is empty"),
        (json.dumps({"inputs": [{"text": "x" * 10_000_000}]}), "more than the 2,000,000"),
        ('{"inputs": [{"turns": ', "json"),
    ]
    for body, message in [(text.encode(), message) for text, message in bad_requests] + _big_bad_requests():
        status, answer = _post(server, body)
        assert 400 <= status < 500, (status, answer[:500])
        assert message.lower() in answer.lower() and len(answer.encode()) <= 2048, answer[:500]
    assert _post(server, json.dumps({"inputs": [CONVERSATION]}).encode())[0] == 200  # still serving
    assert MARKER not in (registered[1] / "serve.log").read_text()  # the server logged no request body


@pytest.mark.slow
def test_serving_eight_concurrent_clients_five_requests_each_without_error(server):
    def client(k: int) -> list[int]:
        return [_post(server, json.dumps({"inputs": [{**CONVERSATION, "id": f"c{k}-{i}"}]}).encode())[0] for i in range(5)]

    with ThreadPoolExecutor(8) as pool:
        statuses = [s for result in pool.map(client, range(8)) for s in result]
    assert statuses == [200] * 40


def test_memalpha_write_reads_turns_prints_progress_and_writes_json(tmp_path, capsys):
    from memalpha.cli import main
    from memalpha.models.policy import load_policy

    config = load_config(ROOT / "configs" / "tiny.yaml")
    load_policy(config.model, seed=0).save_adapter(tmp_path / "adapter")
    turns = tmp_path / "turns.jsonl"
    turns.write_text("\n".join(json.dumps({"speaker": "Maya", "text": f"Fact number {i}: I keep {i} cats at home.",
                                           "date": f"{i % 28 + 1} May 2023"}) for i in range(300)) + "\n")
    out = tmp_path / "memory.json"
    code = main(["write", "--model", str(tmp_path / "adapter"), "--config", str(ROOT / "configs" / "tiny.yaml"),
                 "--input", str(turns), "--out", str(out)])
    assert code == 0
    memory = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert f"writing: {memory['chunks']}/{memory['chunks']} chunks" in printed and "ETA" in printed
    assert memory["id"] == "turns" and memory["chunks"] > 3 and {"core", "semantic", "episodic"} <= set(memory)


def test_memalpha_write_names_the_bad_line(tmp_path, capsys):
    from memalpha.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"speaker": "Maya", "text": "hi"}\n{"speaker": "Maya", "text": 5}\n')
    assert main(["write", "--input", str(bad), "--out", str(tmp_path / "m.json")]) == 2
    assert "turns[1].text: expected a string, got int" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_requests_that_arrive_while_the_writer_is_busy_are_written_together():
    import threading

    from serving.writer_model import RequestBatcher

    calls, gate = [], threading.Event()

    def write(conversations):
        calls.append(list(conversations))
        if len(calls) == 1:
            gate.wait(5)  # the first batch is busy while the others arrive
        return [f"memory of {c}" for c in conversations]

    batcher = RequestBatcher(write)
    results = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, batcher([f"a{k}", f"b{k}"]))) for k in range(4)]
    threads[0].start()
    while not calls:
        pass
    for t in threads[1:]:
        t.start()
    while len(batcher.pending) < 3:
        pass
    gate.set()
    for t in threads:
        t.join(10)
    assert results == {k: [f"memory of a{k}", f"memory of b{k}"] for k in range(4)}
    assert batcher.batches == [1, 3] and len(calls[1]) == 6


def test_write_progress_says_writing_goes_on_during_a_long_call():
    from memalpha.progress import WriteProgress

    lines = []
    with WriteProgress(4, lines.append, heartbeat=0.3, label="w") as progress:
        time.sleep(1.0)  # one long batched call: no chunk finished yet
        progress(4)
    assert any(line.startswith("w: 0/4 chunks | writing the next ones") for line in lines)
    assert lines[-1].startswith("w: 4/4 chunks |") and "ETA 0s" in lines[-1]


def test_where_it_is_served_the_engine_and_reader_can_change_and_a_bad_one_is_named(monkeypatch):
    from memalpha.errors import UserError
    from serving.writer_model import ENGINE_ENV, READER_ENV, served_config

    config = load_config(ROOT / "configs" / "tiny.yaml")
    assert served_config(config) == config
    monkeypatch.setenv(ENGINE_ENV, "llamacpp")
    monkeypatch.setenv(READER_ENV, "qwen2.5-coder-1.5b")
    served = served_config(config)
    assert (served.rollout.engine, served.model.reader) == ("llamacpp", "qwen2.5-coder-1.5b")
    assert served.model.policy == config.model.policy
    monkeypatch.setenv(READER_ENV, "gpt-9")
    with pytest.raises(UserError, match="MEMALPHA_WRITER_READER='gpt-9'"):
        served_config(config)


def test_a_server_the_writer_needs_being_down_is_a_short_503_and_a_bad_setting_a_400(monkeypatch):
    from mlflow.exceptions import MlflowException

    from memalpha.models import llamacpp
    from memalpha.models.llamacpp import LlamaServerError
    from memalpha.errors import UserError
    from serving.writer_model import write_or_explain

    def down(conversations):
        raise LlamaServerError("the llama.cpp server qwen2.5-coder-1.5b at 127.0.0.1:8202 is down: "
                               "start it with `bash infra/servers.sh start-llama qwen2.5-coder-1.5b`" + " ..." * 400)

    def refused(conversations):
        raise UserError("model.reader=qwen2.5-coder-1.5b: the model is not prepared (`make llm`)")

    def not_up(conversations):  # the reader's server is checked when the first questions arrive
        llamacpp.check_server("qwen2.5-coder-1.5b", timeout=0.5)

    with pytest.raises(MlflowException) as down_error:
        write_or_explain(down, ["a"])
    assert down_error.value.get_http_status_code() == 503
    assert down_error.value.message.startswith("the llama.cpp server qwen2.5-coder-1.5b")
    assert down_error.value.message.endswith("characters cut)"), "the message is cut short"
    with pytest.raises(MlflowException, match="make llm") as refused_error:
        write_or_explain(refused, ["a"])
    assert refused_error.value.get_http_status_code() == 400
    assert write_or_explain(lambda conversations: [c.upper() for c in conversations], ["a"]) == ["A"]
    monkeypatch.setenv("MEMALPHA_LLAMA_PORT_OFFSET", "990")  # no server there
    with pytest.raises(MlflowException, match="start-llama qwen2.5-coder-1.5b") as not_up_error:
        write_or_explain(not_up, ["a"])
    assert not_up_error.value.get_http_status_code() == 503
