"""Readers (evidence, local frozen model, OpenAI-compatible HTTP) and LLM judges."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from memalpha.config import ModelConfig
from memalpha.data.schema import Question
from memalpha.models.judges import (
    JudgeItem,
    LocalModelJudge,
    OpenAIJudge,
    make_judge,
    parse_verdict,
)
from memalpha.models.openai_client import EndpointError, OpenAIChatClient
from memalpha.models.policy import load_policy
from memalpha.models.readers import (
    NO_ANSWER,
    EvidenceReader,
    LocalModelReader,
    OpenAIReader,
    ReaderItem,
    make_reader,
)
from memalpha.rewards.qa import score_answer


def q(text: str, answers: list[str], qtype: str = "single_hop", superseded: list[str] | None = None) -> Question:
    return Question("q1", text, answers, qtype, None, superseded or [])


CONTEXT = """[core]
Maya is a nurse who lives in Lisbon.

[semantic]
- sem-1: Maya's dog is named Biscuit.
- sem-2: Maya's sister Ana works at the city library.

[episodic]
- epi-3: On 2024-03-02 Maya ran the Lisbon half marathon in 1:52."""


# ---- evidence reader --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "question,answers,expected",
    [
        ("What is Maya's dog called?", ["Biscuit"], "Biscuit"),
        ("Where does Ana work?", ["the City Library", "library"], "the City Library"),  # normalised match
        ("When did Maya run the half marathon?", ["2024-03-02"], "2024-03-02"),
        ("What is Maya's cat called?", ["Whiskers"], NO_ANSWER),
        ("What does Maya eat?", ["nut"], NO_ANSWER),  # no partial-word matches ("nurse")
    ],
)
def test_evidence_reader_extractive(question, answers, expected):
    (answer,) = EvidenceReader().answer([ReaderItem(CONTEXT, q(question, answers))])
    assert answer == expected
    assert score_answer(answer, answers, "accurate_retrieval") == (1.0 if expected else 0.0)


def test_evidence_reader_boxed_label_needs_the_example():
    question = q("Classify: the package arrived broken and late. Label?", ["7"], "classification")
    with_example = "[semantic]\n- sem-1: Example 'package arrived broken and late' has label 7."
    label_only = "[semantic]\n- sem-1: Label 7 is a common label.\n- sem-2: I like late trains."
    reader = EvidenceReader()
    answers = reader.answer([ReaderItem(with_example, question), ReaderItem(label_only, question), ReaderItem("", question)])
    assert answers == ["\\boxed{7}", NO_ANSWER, NO_ANSWER]
    assert score_answer(answers[0], ["7"], "test_time_learning") == 1.0


def test_evidence_reader_boxed_label_is_the_nearest_example():
    question = q('Which label fits "My credit card was stolen, block it"? Answer as \\boxed{label}.', ["3"], "classification")
    context = (
        '- sem-1: "My debit card was stolen, please block it." has label 3.\n'
        '- sem-2: "The payment to my landlord bounced yesterday." has label 1.\n'
        "- sem-3: Tessa likes label makers."
    )
    assert EvidenceReader().answer([ReaderItem(context, question)]) == ["\\boxed{3}"]
    swapped = context.replace("label 3", "label 9")
    (answer,) = EvidenceReader().answer([ReaderItem(swapped, question)])
    assert answer == "\\boxed{9}" and score_answer(answer, ["3"], "test_time_learning") == 0.0


def test_evidence_reader_keywords_report_what_memory_kept():
    question = q("Summarise Maya's spring.", ["marathon", "Biscuit", "promotion"], "summary")
    (answer,) = EvidenceReader().answer([ReaderItem(CONTEXT, question)])
    assert answer == "marathon, Biscuit"
    assert score_answer(answer, question.answers, "long_range_understanding") == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "context,expected",
    [
        ("- sem-1: Maya lives in Porto.", "Porto"),  # updated in place
        ("- sem-1: Maya lives in Lisbon.", "Lisbon"),  # stale only: answers the stale value
        ("- sem-1: Maya moved from Lisbon to Porto.", "Porto"),  # obsolescence cue
        ("- sem-1: New address is Porto (the old Lisbon flat is sold).", "Porto"),
        ("- sem-1: Maya does not live in Lisbon anymore.", NO_ANSWER),
        ("- sem-1: Maya lives in Lisbon.\n- sem-4: Maya lives in Porto.", "Lisbon; Porto"),  # stale copy kept
        ("- sem-1: Maya has a dog.", NO_ANSWER),
    ],
)
def test_evidence_reader_conflicts(context, expected):
    question = q("Where does Maya live now?", ["Porto"], "conflict", superseded=["Lisbon"])
    (answer,) = EvidenceReader().answer([ReaderItem(context, question)])
    assert answer == expected
    assert score_answer(answer, ["Porto"], "conflict", superseded=["Lisbon"]) == (1.0 if expected == "Porto" else 0.0)


def test_make_reader_choices():
    assert isinstance(make_reader(ModelConfig()), EvidenceReader)
    with pytest.raises(ValueError, match="needs the loaded policy"):
        make_reader(ModelConfig(reader="local"))
    with pytest.raises(ValueError, match="openai_model is empty"):
        make_reader(ModelConfig(reader="openai"))
    reader = make_reader(ModelConfig(reader="openai", openai_model="m", openai_base_url="http://h:1/v1/"))
    assert isinstance(reader, OpenAIReader) and reader.client.url == "http://h:1/v1/chat/completions"


# ---- local model reader and judge -------------------------------------------------------------------


def test_local_reader_uses_the_frozen_base():
    policy = load_policy(ModelConfig(policy="tiny", dtype="float32", device="cpu"))
    reader = LocalModelReader(policy, max_new_tokens=5)
    items = [ReaderItem(CONTEXT, q("What is Maya's dog called?", ["Biscuit"])), ReaderItem("", q("Where?", ["x"], "classification"))]
    before = reader.answer(items)
    with torch.no_grad():
        for name, param in policy.model.named_parameters():
            if "lora_B" in name:
                param.add_(1.0)
    assert reader.answer(items) == before  # training the adapter does not move the reader
    assert len(before) == 2 and all(isinstance(a, str) for a in before)

    judge = make_judge(ModelConfig(judge="local"), policy)
    assert isinstance(judge, LocalModelJudge)
    verdicts = judge.judge([JudgeItem("semantic", "Maya's dog is Biscuit.", "Maya: my dog is Biscuit")])
    assert verdicts in ([True], [False])


# ---- verdict parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,valid",
    [
        ("VALID", True),
        ("valid.", True),
        ("Verdict: VALID", True),
        ("INVALID", False),
        ("invalid", False),
        ("Not valid", False),
        ("VALID or INVALID", False),
        ("", False),
        ("Yes", False),
        ("The write looks fine", False),
        ("VALIDATED", False),
    ],
)
def test_parse_verdict_is_strict(text, valid):
    assert parse_verdict(text) is valid


# ---- OpenAI-compatible endpoint over real HTTP -------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    requests: list[dict] = []
    auth: list[str | None] = []

    def do_POST(self):  # noqa: N802 (http.server API)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, **body})
        type(self).auth.append(self.headers.get("Authorization"))
        if body["model"] == "broken":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"model exploded")
            return
        user = body["messages"][-1]["content"]
        if "VALID or INVALID" in user:
            content = "INVALID" if "nonsense" in user else "VALID"
        else:
            content = " \\boxed{7} " if "Reply with the label only" in body["messages"][0]["content"] else " Biscuit "
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Handler.requests, _Handler.auth = [], []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_openai_reader_over_http(server, monkeypatch):
    monkeypatch.setenv("MY_READER_KEY", "sk-secret-123")
    cfg = ModelConfig(reader="openai", openai_base_url=server, openai_model="reader-1", openai_api_key_env="MY_READER_KEY", reader_max_new_tokens=16)
    reader = make_reader(cfg)
    items = [
        ReaderItem(CONTEXT, q("What is Maya's dog called?", ["Biscuit"])),
        ReaderItem(CONTEXT, q("Classify: x", ["7"], "classification")),
        ReaderItem(CONTEXT, q("Dog?", ["Biscuit"])),
    ]
    assert reader.answer(items) == ["Biscuit", "\\boxed{7}", "Biscuit"]
    assert len(_Handler.requests) == 3
    first = _Handler.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["model"] == "reader-1" and first["max_tokens"] == 16
    assert "Maya's dog is named Biscuit" in first["messages"][-1]["content"]
    assert set(_Handler.auth) == {"Bearer sk-secret-123"}


def test_openai_judge_over_http(server):
    judge = make_judge(ModelConfig(judge="openai", openai_base_url=server, openai_model="judge"))
    assert isinstance(judge, OpenAIJudge)
    items = [JudgeItem("semantic", "Maya's dog is Biscuit.", "chunk"), JudgeItem("semantic", "nonsense", "chunk")]
    assert judge.judge(items) == [True, False]


def test_openai_errors_are_clear_and_never_leak_the_key(server, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-never-shown")
    broken = OpenAIChatClient(server, "broken")
    with pytest.raises(EndpointError, match="HTTP 500: model exploded") as info:
        broken.complete([{"role": "user", "content": "hi"}], 4)
    assert "sk-never-shown" not in str(info.value)

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    reader = OpenAIReader(OpenAIChatClient(f"http://127.0.0.1:{port}/v1", "m", timeout=5))
    with pytest.raises(EndpointError, match=f"cannot reach the OpenAI-compatible endpoint http://127.0.0.1:{port}") as info:
        reader.answer([ReaderItem("", q("?", ["a"]))])
    assert "sk-never-shown" not in str(info.value)


def test_data_prep_closed_book_filter_over_http(server, tmp_path, capsys):
    """`data prep --closed-book openai` drops the question the reader answers without any memory."""
    import polars as pl

    from memalpha.cli import main
    from memalpha.data.io import read_dataset

    src, out = tmp_path / "in.parquet", tmp_path / "out"
    questions = [{"question": "What is Maya's dog called?", "answer": "Biscuit"}, {"question": "Cat?", "answer": "Tom"}]
    pl.DataFrame({
        "instance_id": ["pets"], "data_source": ["squad"],
        "chunks": [json.dumps(["Maya's dog is named Biscuit and her cat is called Tom."])],
        "questions_and_answers": [json.dumps(questions)],
    }).write_parquet(src)
    assert main(["data", "prep", "--source", "memalpha", "--path", str(src), "--out", str(out), "--tokenizer", "regex",
                 "--closed-book", "openai", "--set", f"model.openai_base_url={server}", "--set", "model.openai_model=r"]) == 0
    [instance] = read_dataset(out)
    assert [q.answers for q in instance.questions] == [["Tom"]]
    assert "rejected by closed_book: 1" in capsys.readouterr().out
    assert len(_Handler.requests) == 2  # one closed-book question each
