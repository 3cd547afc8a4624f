"""`memalpha data synth|prep|show`: build, import and inspect datasets."""

from __future__ import annotations

import sys
from collections import defaultdict

from memalpha.config import load_config
from memalpha.data.loaders import SOURCES
from memalpha.errors import UserError
from memalpha.rewards.question_types import COMPETENCIES


def register(subparsers) -> None:
    parser = subparsers.add_parser("data", help="synthesize, prepare and inspect datasets")
    sub = parser.add_subparsers(dest="data_command", required=True)

    def common(p, tokenizer_default: str = "auto") -> None:
        p.add_argument("--config", help="YAML config file (default: embedded defaults)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
        p.add_argument("--tokenizer", choices=["auto", "policy", "regex"], default=tokenizer_default,
                       help="token counting: the policy's tokenizer, the regex counter, or policy when available")

    synth = sub.add_parser("synth", help="generate the synthetic benchmark")
    synth.add_argument("--out", required=True, help="output dataset folder")
    synth.add_argument("--preset", choices=["train", "longgen"], help="start from a preset (knobs below override it)")
    synth.add_argument("--instances", type=int)
    synth.add_argument("--chunks-per-instance", help="one number, or a comma-separated list cycled over instances")
    synth.add_argument("--chunk-tokens", type=int)
    synth.add_argument("--facts", type=int, dest="facts_per_instance", help="facts (questions) per instance")
    synth.add_argument("--distractor-share", type=float, help="share of chunks with small talk only")
    synth.add_argument("--updates-per-fact", type=int, help="most updates of a conflict-resolution fact")
    synth.add_argument("--competencies", help=f"comma-separated subset of {','.join(COMPETENCIES)}")
    synth.add_argument("--seed", type=int)
    synth.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    common(synth)
    synth.set_defaults(handler=_synth)

    prep = sub.add_parser("prep", help="load, chunk, validate and split a dataset")
    prep.add_argument("--source", required=True, choices=SOURCES)
    prep.add_argument("--path", required=True, help="input file or folder")
    prep.add_argument("--out", required=True, help="output dataset folder")
    prep.add_argument("--drop-invalid", action="store_true", help="drop invalid rows instead of failing")
    prep.add_argument("--competency", choices=COMPETENCIES,
                      help="competency of every instance (default: the data's own field, else conflict_resolution "
                           "when questions list superseded values, else guessed from the data-source name, with a note)")
    prep.add_argument("--chunk-tokens", type=int, help="chunk size for raw sources (default: data.chunk_tokens)")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    prep.add_argument("--closed-book", choices=["off", "local", "openai"], default="off",
                      help="drop questions this reader answers with an empty memory: local = the frozen base "
                           "policy, openai = model.openai_base_url (default: off)")
    common(prep)
    prep.set_defaults(handler=_prep)

    show = sub.add_parser("show", help="summarize a dataset folder")
    show.add_argument("path", help="dataset folder or Memalpha parquet file")
    common(show, tokenizer_default="regex")
    show.set_defaults(handler=_show)


def _tokenizer(choice: str, config):
    """(tokenizer or counter, name) for --tokenizer."""
    from memalpha.tokens import regex_token_count

    if choice == "regex":
        return regex_token_count, "regex"
    try:
        from memalpha.models.loading import load_tokenizer, resolve_model_path

        return load_tokenizer(resolve_model_path(config.model.policy)), config.model.policy
    except Exception as exc:  # model missing, not prepared, or not loadable offline
        if choice == "policy":
            raise UserError(f"cannot load the tokenizer of policy {config.model.policy!r}: {exc} "
                            "(use --tokenizer regex to count tokens without it)") from None
        print(f"note: policy tokenizer unavailable ({exc}); counting tokens with the regex counter", file=sys.stderr)
        return regex_token_count, "regex"


def _print_summary(summary) -> None:
    print(f"wrote {summary.out_dir}")
    for key, value in summary.counts.items():
        print(f"  {key.replace('_', ' ')}: {value}")
    print("  splits: " + ", ".join(f"{k} {v}" for k, v in summary.split_counts.items()))
    for check, n in sorted(summary.rejected_by_check.items()):
        print(f"  rejected by {check}: {n}")
    for note in summary.notes:
        print(f"  note: {note}")


def _synth(args) -> int:
    from dataclasses import replace

    from memalpha.data.prep import synthesize
    from memalpha.data.synth import PRESETS, SynthConfig

    config = load_config(args.config, args.set)
    knobs = {}
    for name in ("instances", "chunk_tokens", "facts_per_instance", "distractor_share", "updates_per_fact", "seed"):
        if getattr(args, name) is not None:
            knobs[name] = getattr(args, name)
    try:
        if args.chunks_per_instance:
            knobs["chunks_per_instance"] = tuple(int(x) for x in args.chunks_per_instance.split(","))
        if args.competencies:
            knobs["competencies"] = tuple(c.strip() for c in args.competencies.split(","))
        synth_cfg = replace(PRESETS[args.preset], **knobs) if args.preset else SynthConfig(**knobs)
        tokenizer, name = _tokenizer(args.tokenizer, config)
        summary = synthesize(args.out, synth_cfg, tokenizer=tokenizer, tokenizer_name=name, data_cfg=config.data,
                             overwrite=args.overwrite, progress=True)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    _print_summary(summary)
    return 0


def _prep(args) -> int:
    from memalpha.data.prep import prepare

    config = load_config(args.config, args.set)
    if args.chunk_tokens is not None and not 512 <= args.chunk_tokens <= 4096:
        raise UserError(f"--chunk-tokens must be in 512..4096, got {args.chunk_tokens}")
    tokenizer, name = _tokenizer(args.tokenizer, config)
    summary = prepare(args.source, args.path, args.out, tokenizer=tokenizer, tokenizer_name=name, data_cfg=config.data,
                      chunk_tokens=args.chunk_tokens, drop_invalid=args.drop_invalid, overwrite=args.overwrite,
                      reader=_closed_book_reader(args.closed_book, config), progress=True, competency=args.competency)
    _print_summary(summary)
    return 0


def _closed_book_reader(choice: str, config):
    """The closed-book filter's reader for --closed-book (None: off)."""
    if choice == "off":
        return None
    from memalpha.models.readers import closed_book, make_reader

    model_cfg = config.model.model_copy(update={"reader": choice})
    policy = None
    if choice == "local":
        from memalpha.models.policy import load_policy

        policy = load_policy(model_cfg, trainable=False)
    try:
        return closed_book(make_reader(model_cfg, policy))
    except ValueError as exc:
        raise UserError(f"--closed-book {choice}: {exc}") from None


def dataset_table(instances, count_tokens) -> list[dict]:
    """Rows of `data show`: per competency and split, instances, chunks, tokens and questions."""
    groups: dict[tuple[str, str], dict[str, int]] = defaultdict(lambda: {"instances": 0, "chunks": 0, "tokens": 0, "questions": 0})
    for inst in instances:
        for key in ((inst.competency, inst.split or "-"), ("all", inst.split or "-"), ("all", "all")):
            g = groups[key]
            g["instances"] += 1
            g["chunks"] += len(inst.chunks)
            g["tokens"] += sum(count_tokens(c) for c in inst.chunks)
            g["questions"] += len(inst.questions)
    order = {c: i for i, c in enumerate([*COMPETENCIES, "all"])}
    split_order = {s: i for i, s in enumerate(["train", "validation", "test", "-", "all"])}
    keys = sorted(groups, key=lambda k: (order.get(k[0], 99), split_order.get(k[1], 99)))
    return [{"competency": c, "split": s, **groups[(c, s)]} for c, s in keys]


def _show(args) -> int:
    from memalpha.data.chunking import TokenCounts
    from memalpha.data.io import read_dataset, read_manifest

    config = load_config(args.config, args.set)
    instances = read_dataset(args.path)
    tokenizer, name = _tokenizer(args.tokenizer, config)
    counter = TokenCounts(tokenizer)
    rows = dataset_table(instances, counter.count)
    manifest = read_manifest(args.path)
    print(f"{args.path}: {len(instances)} instances" + (f" (source: {manifest['source']})" if manifest.get("source") else ""))
    header = ["competency", "split", "instances", "chunks", f"tokens ({name})", "questions"]
    table = [[str(r["competency"]), str(r["split"]), str(r["instances"]), str(r["chunks"]), str(r["tokens"]),
              str(r["questions"])] for r in rows]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for line in [header, *table]:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    rejected = manifest.get("rejected_by_check") or {}
    if rejected:
        print("rejected during prep: " + ", ".join(f"{k} {v}" for k, v in sorted(rejected.items())))
    return 0
