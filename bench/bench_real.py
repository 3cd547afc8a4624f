"""Report of record on real conversations: does a writer trained on a mix of synthetic and real dialogue
remember LoCoMo conversations it never saw better than RAG, long context and the synthetic-only writer?

Data (`memalpha.data.conversations`): LoCoMo (snap-research/LoCoMo `data/locomo10.json`) split by
conversation, conv-26 and conv-30 to train (in windows of at most 2,048 tokens), conv-41 to validate
(windows), the seven others whole to test; PerLTQA (English v2) by character, where its files are present.
Everything chunked at the writer's 512 tokens.
Warm start: SFT from the shipped warm start (`sft.init_adapter`) on `DEMONSTRATIONS` demonstrations, half
rule-writer demonstrations of the synthetic learning data, half evidence-writer demonstrations of the
real training windows (`sft.mix`). GRPO: the recipe, `SEEDS` x `STEPS` step-level steps, on the mix
`MIX` (`data.mix`). Test: greedy, BM25 top-20 retrieval, one 1,024-token reader budget; readers `evidence`
and `local` (frozen SmolLM2-135M, greedy); metrics substring match `qa` and LoCoMo's token F1 `f1`, by
LoCoMo category; methods: the trained writer (seeds' mean, `qa_seed_std`, each seed), its warm start,
the shipped synthetic-only writer, the rule writer, BM25 RAG top-2, long context, no memory; and the trained
writer minus each method paired by question, with a 95% bootstrap interval over questions. The trained
seeds are also tested on the synthetic learning bench's 48 held-out conversations (does the mix keep
what synthetic training learned?).

Another policy (`MEMALPHA_BENCH_REAL_POLICY=qwen2.5-coder-0.5b`) trains in `runs/bench-real-<policy>` from a
warm start of its own: SFT of a fresh LoRA (the 135M warm start does not fit it) on the demonstrations of
`MEMALPHA_BENCH_REAL_TEACHER` (by default for such a policy the LLM teacher `llm:qwen2.5-coder-1.5b`, best of
4 samples of `TEACHER_WINDOWS` windows of each real dataset, the rule writer's demonstrations of the synthetic
data beside them (`TEACHER_SCOPE`); its llama.cpp server is started here when none is up).

Resumable: runs live in `RUN_ROOT` and resume from their checkpoints; every method's build (the memories
and reader contexts) is cached under `MEMORIES/<key>.json` (shared by every policy), keyed by the digest of the adapter
weights (or the baseline's name) and of the test data, and each reader's scored rows beside it, so the
report is rebuilt from the caches without writing a memory again. Needs the LoCoMo file at
`MEMALPHA_LOCOMO` (default data/raw/locomo10.json) and optionally the PerLTQA folder at
`MEMALPHA_PERLTQA` (default data/raw/perltqa). About 5 hours alone on a 2-core CPU (1 h of GRPO, then
about 26 min a writer: 12-13 min writing the 7 test conversations, 13 min of local-reader answers), so on a
CPU it runs only with MEMALPHA_BENCH_REAL_ON_CPU=1; run it alone (one process of it held 10 GB after the
three seeds). Stop it between methods to lose no writing: each finished build and answer set is kept.

    MEMALPHA_BENCH_REAL_ON_CPU=1 python -m bench.run_all real
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from bench import BenchmarkSkipped
from bench.bench_learning import best_seed, curve, curve_table, test_instances, train_run, training_data

ROOT = Path(__file__).resolve().parents[1]
SEEDS = tuple(int(s) for s in os.environ.get("MEMALPHA_BENCH_REAL_SEEDS", "0 1 2").split())
STEPS = int(os.environ.get("MEMALPHA_BENCH_REAL_STEPS", "20"))
ON_CPU = os.environ.get("MEMALPHA_BENCH_REAL_ON_CPU") == "1"
SHIP = os.environ.get("MEMALPHA_BENCH_REAL_SHIP") == "1"
"""Ship the trained writer (the recipe's policy) or an LLM-taught warm start (another policy) into adapters/."""
STAGE = os.environ.get("MEMALPHA_BENCH_REAL_STAGE", "all")
"""`prep`, `warm-start`, `train` or `all`: stop after that stage (a long run in parts)."""
LOCOMO = Path(os.environ.get("MEMALPHA_LOCOMO", ROOT / "data" / "raw" / "locomo10.json"))
PERLTQA = Path(os.environ.get("MEMALPHA_PERLTQA", ROOT / "data" / "raw" / "perltqa"))
READERS = ("evidence", "local")
CHUNK_TOKENS = 512
DEMONSTRATIONS = 256
DATA = ROOT / "data" / "real"
POLICY = os.environ.get("MEMALPHA_BENCH_REAL_POLICY", "smollm2-135m-instruct")
RECIPE_POLICY = POLICY == "smollm2-135m-instruct"
"""The recipe's policy starts from the shipped 135M warm start; another gets a warm start of its own."""
TEACHER = os.environ.get("MEMALPHA_BENCH_REAL_TEACHER", "rule" if RECIPE_POLICY else "llm:qwen2.5-coder-1.5b")
TEACHER_WINDOWS = int(os.environ.get("MEMALPHA_BENCH_REAL_TEACHER_WINDOWS", "16")) or None
"""An LLM teacher's windows of each dataset it teaches (0: all of them): 16 windows x 4 samples is about 50 min
of the 1.5B on 2 cores."""
TEACHER_SCOPE = os.environ.get("MEMALPHA_BENCH_REAL_TEACHER_SCOPE", "dialogue")
"""What an LLM teacher labels (`llm_teacher.SCOPES`): the LoCoMo (and PerLTQA) windows, the rule writer the
synthetic data (`dialogue`: the 1.5B kept 1 of 16 synthetic windows, docs/experiments.md L-T1), or every
dataset (`all`)."""


def run_root(policy: str) -> Path:
    """Where a policy's warm start and GRPO seeds live."""
    return ROOT / "runs" / ("bench-real" if policy == "smollm2-135m-instruct" else f"bench-real-{policy}")


RUN_ROOT = run_root(POLICY)
MEMORIES = ROOT / "runs" / "bench-real" / "memories"
WRITER = ROOT / "adapters" / "writer"
BASE_WARM_START = ROOT / "adapters" / "warm-start"
DIALOGUE_WARM_START = ROOT / "adapters" / "warm-start-dialogue"
"""The warm start of this report, shipped: restored instead of trained when its record's hash is the recipe's."""
CHECKPOINT_EVERY = 5
BASELINES = ("rule_writer", "rag", "long_context", "no_memory")
LOCOMO_CATEGORIES = ("single_hop", "multi_hop", "temporal", "open_domain")


def prepare_data() -> dict[str, Path]:
    """The real datasets, prepared once at the writer's chunk size: {source: folder}."""
    from memalpha.config import load_config
    from memalpha.data.prep import prepare
    from memalpha.models.loading import default_model_dir, load_tokenizer

    if not LOCOMO.is_file():
        raise FileNotFoundError(f"{LOCOMO}: the LoCoMo file (snap-research/LoCoMo data/locomo10.json) is needed; "
                                "set MEMALPHA_LOCOMO to where it is")
    inputs = {"locomo": LOCOMO, **({"perltqa": PERLTQA} if PERLTQA.exists() else {})}
    tokenizer_name = str(default_model_dir())
    out = {}
    for source, path in inputs.items():
        folder = DATA / source
        if not (folder / "manifest.json").is_file():
            print(f"preparing {source} from {path}", flush=True)
            prepare(source, path, folder, tokenizer=load_tokenizer(tokenizer_name), tokenizer_name=tokenizer_name,
                    data_cfg=load_config(None).data, chunk_tokens=CHUNK_TOKENS, drop_invalid=True, overwrite=True)
        out[source] = folder
    return out


def mix(data: dict[str, Path]) -> dict[str, float]:
    """The training mix: the synthetic learning data and each real source, equal weights."""
    return {str(training_data()): 1.0, **{str(folder): 1.0 for folder in data.values()}}


def base_overrides(data: dict[str, Path]) -> list[str]:
    weights = json.dumps(mix(data))
    start = [f"sft.init_adapter={BASE_WARM_START}"] if RECIPE_POLICY else [f"model.policy={POLICY}"]
    return [f"data.mix={weights}", f"sft.mix={weights}", *start,
            f"sft.num_demonstrations={DEMONSTRATIONS}", "eval.max_instances=8", "time_budget_minutes=null"]


def seed_config(seed: int, data: dict[str, Path]):
    from memalpha.config import load_config

    return load_config(None, [*base_overrides(data), f"output_dir={RUN_ROOT / f'seed{seed}'}", f"grpo.seed={seed}",
                              f"grpo.steps={STEPS}", f"grpo.eval_every={STEPS}", f"grpo.checkpoint_every={CHECKPOINT_EVERY}"])


def warm_start(data: dict[str, Path]) -> Path:
    """The seeds' one warm start, `RUN_ROOT/warm-start/sft`: the rule writer's (DIALOGUE_WARM_START when its hash
    is this recipe's, else trained once, then reused) or an LLM teacher's (`taught_warm_start`)."""
    from memalpha.teacher.warm_start import prepare_warm_start
    from memalpha.training.checkpoint import SFT_DIR

    folder = RUN_ROOT / "warm-start"
    started = time.perf_counter()
    if TEACHER != "rule":
        taught_warm_start(seed_config(SEEDS[0], data), folder / SFT_DIR)
    elif not (folder / SFT_DIR / "adapter_model.safetensors").is_file():
        print(f"warm start of {POLICY}: SFT of {DEMONSTRATIONS} demonstrations by the rule writer", flush=True)
        prepare_warm_start(seed_config(SEEDS[0], data), folder, shipped=DIALOGUE_WARM_START)
    print(f"warm start ready in {(time.perf_counter() - started) / 60:.1f} min", flush=True)
    return folder / SFT_DIR


def taught_warm_start(config, out: Path) -> None:
    """The warm start in `out` taught by the LLM `TEACHER` (`memalpha sft --teacher`): restored from
    `adapters/warm-start-<policy>` when its record's hash is this recipe's and `out` is empty; else trained
    (an adapter already in `out` is reused when the same teacher taught it, refused otherwise), its teacher's
    server started only while windows are missing from the sample cache. With MEMALPHA_BENCH_REAL_SHIP=1 it
    is shipped there, with its record, unless that already holds it."""
    from bench.llama_server import local_llama_server
    from memalpha.errors import UserError
    from memalpha.models.llamacpp import check_server
    from memalpha.models.policy import load_policy
    from memalpha.progress import SFTProgress
    from memalpha.teacher import record
    from memalpha.teacher.llm_teacher import LLMTeacher
    from memalpha.teacher.warm_start import ADAPTER_FILE, ship_warm_start, warm_start_data, warm_start as train

    def server():  # one that is up (the user's) is used as it is
        try:
            check_server(teacher.model)
            return nullcontext()
        except UserError:
            return local_llama_server(RUN_ROOT / "llama-state" / teacher.model, teacher.model, offset=0)

    teacher = LLMTeacher.from_spec(TEACHER, windows=TEACHER_WINDOWS, scope=TEACHER_SCOPE,
                                   say=lambda line: print(line, flush=True), server=server)
    shipped = ROOT / "adapters" / f"warm-start-{POLICY}"
    wanted, kept = record.warm_start_hash(config, teacher.describe()), record.read_record(shipped)
    if kept is not None and kept["hash"] == wanted and not (out / ADAPTER_FILE).is_file():
        print(f"warm start: {shipped.relative_to(ROOT)} is this recipe's (hash {wanted}): restored", flush=True)
        record.restore(shipped, out)
        return
    print(f"warm start of {POLICY}: SFT of up to {DEMONSTRATIONS} demonstrations taught by {TEACHER} "
          f"(best of {teacher.samples}, {TEACHER_WINDOWS or 'all'} windows a dataset, teaching {TEACHER_SCOPE})", flush=True)
    policy = load_policy(config.model, seed=config.grpo.seed)
    train_set, held_out = warm_start_data(config, policy.tokenizer)
    train(config, out, policy, train_set, held_out, on_log=SFTProgress(lambda line: print(line, flush=True)), teacher=teacher)
    if SHIP and (kept is None or kept["hash"] != wanted):
        entry = ship_warm_start(config, out, policy, held_out, shipped, teacher.describe())
        print(f"warm start shipped to {shipped.relative_to(ROOT)} (hash {entry['hash']})", flush=True)


def train_seed(seed: int, warm: Path, data: dict[str, Path]) -> list[dict[str, Any]]:
    """One GRPO seed from the warm start to STEPS (resumed where it stopped); its curve."""
    history, _ = train_run(seed_config(seed, data), warm, STEPS, f"seed {seed}")
    return curve(history)


def test_sets(data: dict[str, Path]) -> dict[str, list]:
    """{source: its test instances}, whole conversations."""
    from memalpha.data.io import read_dataset

    return {source: [i for i in read_dataset(folder) if i.split == "test"] for source, folder in data.items()}


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()[:16]


def data_key(instances) -> str:
    return _digest(json.dumps([[i.instance_id, i.chunks, [q.question for q in i.questions]] for i in instances]).encode())


def method_key(method: str, adapter: Path | None) -> str:
    """A build's cache key: the adapter's weights (whatever folder holds them), else the baseline's name."""
    if adapter is None:
        return method
    return "adapter-" + _digest((Path(adapter) / "adapter_model.safetensors").read_bytes())


def build(config, instances, method: str, adapter: Path | None, folder: Path, counting=None) -> tuple[list, float]:
    """The method's build for `instances`, from the cache or made now (and cached); its seconds. Sizes and the
    reader budget are counted by `counting`'s policy tokenizer (default `config`'s), so that writers of another
    policy are measured like the others."""
    from bench.run_all import write_atomically
    from memalpha.evaluation.answering import policy_tokenizer, token_counter
    from memalpha.evaluation.methods import Built, EvalEnv, make_method

    path = folder / f"{method_key(method, adapter)}.json"
    if path.is_file():
        kept = json.loads(path.read_text())
        return [Built(**b) for b in kept["built"]], kept["seconds"]
    tokenizer, _ = policy_tokenizer(counting or config)
    env = EvalEnv(config, token_counter(tokenizer), progress=lambda line: print(line, flush=True))
    made = make_method(method, env, adapter)
    started = time.perf_counter()
    try:
        built = made.build(instances, 0)
    finally:
        made.close()
    seconds = time.perf_counter() - started
    folder.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"method": method, "adapter": str(adapter) if adapter else None, "seconds": seconds,
                                       "built": [b.__dict__ for b in built]}))
    return built, seconds


def score(config, instances, name: str, method: str, adapter: Path | None, folder: Path) -> dict[str, dict[str, Any]]:
    """{reader: result} of one method on one test set; rows cached per reader beside the build."""
    from bench.run_all import write_atomically
    from memalpha.data.chunking import TokenCounts
    from memalpha.evaluation.answering import LazyReader, answer_built, policy_tokenizer
    from memalpha.rewards.qa import token_f1

    key = method_key(method, adapter)
    results, built, build_s, input_tokens = {}, None, 0.0, None
    say = partial(print, flush=True)  # progress lines of the reader's answers
    golds = {(i.instance_id, q.question_id): q.answers for i in instances for q in i.questions}
    for reader in READERS:
        path = folder / reader / f"{key}.json"
        if not path.is_file():
            if built is None:
                print(f"{name}: writing ({method})", flush=True)
                built, build_s = build(config, instances, method, adapter, folder)
            if input_tokens is None:
                tokenizer, _ = policy_tokenizer(config)
                input_tokens = [sum(TokenCounts(tokenizer).counts(i.chunks)) for i in instances]
            reader_config = config.model_copy(update={"model": config.model.model_copy(update={"reader": reader})})
            started = time.perf_counter()
            print(f"{name}: answering {sum(len(i.questions) for i in instances)} questions with the {reader} reader", flush=True)
            rows, instance_rows, _ = answer_built(method, instances, 0, built, build_s, LazyReader(reader_config).get(),
                                                  reader_config, input_tokens, say=say)
            for row in rows:
                row["f1"] = token_f1(row["prediction"], golds[(row["instance_id"], row["question_id"])])
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps({"rows": rows, "instances": instance_rows, "build_seconds": build_s,
                                               "answer_seconds": time.perf_counter() - started}))
        kept = json.loads(path.read_text())
        results[reader] = summarize_rows(kept)
    return results


def summarize_rows(kept: dict[str, Any], group: str = "question_type") -> dict[str, Any]:
    """qa and F1 of a reader's cached rows, overall and by the rows' `group` field (`by_category`)."""
    rows = kept["rows"]
    by_type = {}
    for t in sorted({r[group] for r in rows}):
        mine = [r for r in rows if r[group] == t]
        by_type[t] = {"qa": statistics.mean(r["score"] for r in mine), "f1": statistics.mean(r["f1"] for r in mine), "n": len(mine)}
    return {"qa": statistics.mean(r["score"] for r in rows), "f1": statistics.mean(r["f1"] for r in rows),
            "by_category": by_type, "questions": len(rows),
            "memory_tokens": statistics.mean(r["memory_tokens"] for r in kept["instances"]),
            "minutes": round((kept["build_seconds"] + kept["answer_seconds"]) / 60, 1)}


def question_scores(path: Path) -> dict[tuple[str, str], float]:
    """{(instance id, question id): score} of a reader's cached rows."""
    return {(r["instance_id"], r["question_id"]): r["score"] for r in json.loads(path.read_text())["rows"]}


def paired_difference(seeds: list[dict], theirs: dict, resamples: int = 2000) -> dict[str, Any]:
    """Trained (each question's score averaged over the seeds' `question_scores`) minus another method's,
    paired by question: the mean difference and its 95% bootstrap interval over questions."""
    import numpy as np

    diff = np.array([np.mean([s[q] for s in seeds]) - theirs[q] for q in sorted(theirs)])
    means = diff[np.random.default_rng(0).integers(0, len(diff), (resamples, len(diff)))].mean(axis=1)
    return {"diff": float(diff.mean()), "ci95": [float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))]}


def seeds_mean(tests: list[dict[str, Any]]) -> dict[str, Any]:
    qa = [t["qa"] for t in tests]
    return {"qa": statistics.mean(qa), "qa_seed_std": statistics.stdev(qa) if len(qa) > 1 else 0.0, "qa_seeds": qa,
            "f1": statistics.mean(t["f1"] for t in tests), "memory_tokens": statistics.mean(t["memory_tokens"] for t in tests),
            "by_category": {c: {"qa": statistics.mean(t["by_category"][c]["qa"] for t in tests),
                                "f1": statistics.mean(t["by_category"][c]["f1"] for t in tests)}
                            for c in tests[0]["by_category"]},
            "minutes": round(sum(t["minutes"] for t in tests), 1)}


SYNTHETIC_BAR = (0.310, 0.035)
"""The synthetic learning bench of record (bench/results/learning.md): the synthetic-only recipe's local-reader QA
and its seed std; the writer trained on the mix must not fall below their difference."""


def targets(report: dict[str, Any]) -> dict[str, Any]:
    local = report["locomo"]["readers"]["local"]["methods"]
    t, rag = local["trained"], local["rag"]
    synthetic = report["synthetic"]["readers"]["local"]["methods"]["trained"]["qa"]
    return {
        f"synthetic learning bench, local: trained >= {SYNTHETIC_BAR[0]} - {SYNTHETIC_BAR[1]}": synthetic >= SYNTHETIC_BAR[0] - SYNTHETIC_BAR[1],
        "LoCoMo local: trained > BM25 RAG top-2": t["qa"] > rag["qa"],
        "LoCoMo local: trained > long context": t["qa"] > local["long_context"]["qa"],
        "LoCoMo: trained memory <= 25% of RAG's": t["memory_tokens"] <= 0.25 * rag["memory_tokens"],
        "LoCoMo local: trained > warm start by 3 seed std": t["qa"] - local["warm_start"]["qa"] > 3 * t["qa_seed_std"],
        "LoCoMo local: trained > shipped synthetic-only writer": t["qa"] > local["shipped_writer"]["qa"],
    }


def run() -> dict[str, Any]:
    import torch

    from memalpha.training.checkpoint import checkpoint_dir, policy_adapter

    if not torch.cuda.is_available() and not ON_CPU:
        raise BenchmarkSkipped("several hours on a CPU (warm start, 3 seeds x 20 GRPO steps, 5 writers over 7 whole "
                               "LoCoMo conversations); set MEMALPHA_BENCH_REAL_ON_CPU=1 to run it anyway")
    started = time.perf_counter()
    data = prepare_data()
    if STAGE == "prep":
        raise BenchmarkSkipped("stopped after the prep stage (MEMALPHA_BENCH_REAL_STAGE=prep)")
    warm = warm_start(data)
    if STAGE == "warm-start":
        raise BenchmarkSkipped("stopped after the warm start (MEMALPHA_BENCH_REAL_STAGE=warm-start)")
    curves = {seed: train_seed(seed, warm, data) for seed in SEEDS}
    if STAGE == "train" or not RECIPE_POLICY:
        raise BenchmarkSkipped(f"stopped after training {POLICY}: " + ("MEMALPHA_BENCH_REAL_STAGE=train" if RECIPE_POLICY else
                               "the local reader is the 135M policy, so another policy's writers are read by the LLM reader "
                               "(`python -m bench.run_all real_llm`)"))
    config = seed_config(SEEDS[0], data)
    adapters = {f"trained_seed{s}": policy_adapter(checkpoint_dir(RUN_ROOT / f"seed{s}", STEPS)) for s in SEEDS}
    adapters.update({"warm_start": warm, "shipped_writer": WRITER})
    report: dict[str, Any] = {}
    for source, instances in test_sets(data).items():
        folder = MEMORIES / f"{source}-{data_key(instances)}"
        methods = {name: score(config, instances, f"{source} {name}", "policy", path, folder) for name, path in adapters.items()}
        methods.update({name: score(config, instances, f"{source} {name}", name, None, folder) for name in BASELINES})
        keys = {name: method_key("policy", path) for name, path in adapters.items()} | {name: name for name in BASELINES}
        readers = {}
        for reader in READERS:
            by_method = {name: m[reader] for name, m in methods.items()}
            trained = seeds_mean([by_method[f"trained_seed{s}"] for s in SEEDS])
            per_question = {name: question_scores(folder / reader / f"{key}.json") for name, key in keys.items()}
            seeds = [per_question.pop(f"trained_seed{s}") for s in SEEDS]
            readers[reader] = {"methods": {"trained": trained, **by_method},
                               "trained_minus": {name: paired_difference(seeds, theirs) for name, theirs in per_question.items()}}
        report[source] = {"readers": readers, "conversations": len(instances),
                          "questions": sum(len(i.questions) for i in instances),
                          "chunks": sum(len(i.chunks) for i in instances)}
    synthetic = test_instances()  # the learning bench's 48 held-out conversations (288 questions)
    folder = MEMORIES / f"synthetic-{data_key(synthetic)}"
    trained = {f"trained_seed{s}": score(config, synthetic, f"synthetic trained_seed{s}", "policy", adapters[f"trained_seed{s}"], folder)
               for s in SEEDS}
    report["synthetic"] = {"readers": {reader: {"methods": {"trained": seeds_mean([trained[f"trained_seed{s}"][reader] for s in SEEDS]),
                                                            **{name: m[reader] for name, m in trained.items()}}}
                                       for reader in READERS},
                           "conversations": len(synthetic), "questions": sum(len(i.questions) for i in synthetic),
                           "chunks": sum(len(i.chunks) for i in synthetic)}
    report["targets"] = targets(report)
    report["curves"] = curves
    if SHIP:
        report["shipped"] = ship_writer(report, curves, data)
    local = f"{ROOT}/"  # the report names the checkout's paths relative to it
    if "perltqa" not in data:
        report["perltqa"] = {"absent": f"no PerLTQA release at {str(PERLTQA).replace(local, '')} "
                                       "(set MEMALPHA_PERLTQA to the folder of its English v2 files)"}
    report["settings"] = {"seeds": list(SEEDS), "steps": STEPS, "chunk_tokens": CHUNK_TOKENS, "demonstrations": DEMONSTRATIONS,
                          "mix": {name.replace(local, ""): w for name, w in mix(data).items()},
                          "overrides": [o.replace(local, "") for o in base_overrides(data)],
                          "minutes_this_run": round((time.perf_counter() - started) / 60, 1)}
    return report


def ship_writer(report: dict[str, Any], curves: dict[int, list], data: dict[str, Path]) -> dict[str, Any]:
    """The seed with the best validation QA as adapters/writer, when the trained writer beats the shipped one
    on LoCoMo beyond the noise of its questions and holds the synthetic bench; its record names the data,
    splits, chunk size and scores."""
    from memalpha.data.conversations import LOCOMO_SPLITS
    from memalpha.teacher import record
    from memalpha.training.checkpoint import checkpoint_dir, policy_adapter

    beats = report["locomo"]["readers"]["local"]["trained_minus"]["shipped_writer"]["ci95"][0] > 0
    holds = next(v for k, v in report["targets"].items() if k.startswith("synthetic learning bench"))
    if not (beats and holds):
        return {"shipped": False, "why": "needs trained above the shipped writer on LoCoMo (local reader, the paired "
                                         "95% interval above 0) and the synthetic bench held"}
    best, validation = best_seed(curves)
    config = seed_config(best, data)
    scores = {source: {reader: {k: v for k, v in block["methods"][f"trained_seed{best}"].items() if k in ("qa", "f1", "memory_tokens")}
                       for reader, block in report[source]["readers"].items()} for source in ("locomo", "synthetic")}
    entry = {"seed": best, "step": STEPS, "validation_qa": validation[best], "validation_qa_seeds": validation,
             "data": {"mix": mix(data), "locomo_splits": {**LOCOMO_SPLITS, "other conversations": "test"},
                      "perltqa": "hash split by character" if "perltqa" in data else "absent"},
             "warm_start_hash": record.warm_start_hash(config), "chunk_tokens": CHUNK_TOKENS,
             "max_prompt_tokens": config.rollout.max_prompt_tokens,
             "grpo": config.grpo.model_dump(mode="json"), "rollout": config.rollout.model_dump(mode="json"),
             "test": scores["synthetic"], "test_locomo": scores["locomo"],
             "test_set": "synthetic: the learning bench's 48 held-out conversations; LoCoMo: conv-42..conv-50 whole, greedy"}
    record.ship(policy_adapter(checkpoint_dir(RUN_ROOT / f"seed{best}", STEPS)), record.WRITER, entry)
    return {"shipped": True, "seed": best, "validation_qa": validation[best]}


def to_markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = ["# Benchmark: real conversations", "",
             f"Warm start: SFT from adapters/warm-start on {s['demonstrations']} demonstrations of the mix; GRPO seeds "
             f"{', '.join(map(str, s['seeds']))}, {s['steps']} steps each, on the mix {json.dumps(s['mix'])}. Chunks of "
             f"{s['chunk_tokens']} tokens; greedy; BM25 top-20 retrieval, 1,024-token reader budget. `trained` is the "
             f"mean over seeds (qa_seed_std: std over seeds, ddof 1). {s['minutes_this_run']} min this run "
             "(builds and answers kept from earlier runs are read from their caches).", ""]
    for source in ("locomo", "perltqa", "synthetic"):
        if source not in results:
            continue
        r = results[source]
        if "absent" in r:
            lines += [f"## {source}: not run: {r['absent']}", ""]
            continue
        lines += [f"## {source}: {r['conversations']} test conversations, {r['questions']} questions, {r['chunks']} chunks", ""]
        for reader, block in r["readers"].items():
            cats = [c for c in LOCOMO_CATEGORIES if c in block["methods"]["rag"]["by_category"]] if source == "locomo" else []
            lines += [f"### {reader} reader", "",
                      "| method | qa | f1 | qa_seed_std | " + " | ".join(f"{c} qa" for c in cats) + (" | " if cats else "")
                      + "memory tokens | minutes |",
                      "|---|---|---|---|" + "---|" * len(cats) + "---|---|"]
            for name, m in block["methods"].items():
                std = f"{m['qa_seed_std']:.3f}" if "qa_seed_std" in m else ""
                lines.append(f"| {name} | {m['qa']:.3f} | {m['f1']:.3f} | {std} | "
                             + "".join(f"{m['by_category'][c]['qa']:.3f} | " for c in cats)
                             + f"{m['memory_tokens']:.0f} | {m['minutes']} |")
            lines.append("")
            if "trained_minus" in block:
                lines += ["Trained minus each method, paired by question (mean over seeds per question; 95% bootstrap "
                          "interval over questions): " + "; ".join(f"{name} {d['diff']:+.3f} [{d['ci95'][0]:+.3f}, "
                                                                   f"{d['ci95'][1]:+.3f}]" for name, d in block["trained_minus"].items()), ""]
    lines += ["## Targets", "", "| target | met |", "|---|---|"]
    lines += [f"| {name} | {'met' if met else 'missed'} |" for name, met in results["targets"].items()]
    lines += ["", "## GRPO curve per seed", ""] + curve_table(results["curves"])
    return "\n".join(lines) + "\n"
