"""`python -m memalpha.models.prepare [--policy NAME ...] [--llm NAME ...]`: convert packaged GGUF policies
(default: the default policy) into plain cached HF folders once, check the packaged MiniLM embedder is
present, and assemble the packaged LLMs' GGUF files from their part wheels (`--requirements` prints those
wheels' pins for pip). Idempotent; fast when already done."""

from __future__ import annotations

import argparse
import sys
import time

from memalpha.config import DEFAULT_POLICY
from memalpha.models.loading import (
    LLM_MODELS,
    PACKAGED_POLICIES,
    ModelNotPreparedError,
    convert_gguf,
    is_prepared,
    llm_gguf,
    packaged_gguf,
    packaged_minilm,
    packaged_model_dir,
)


def prepare(force: bool = False, policies: tuple[str, ...] = (DEFAULT_POLICY,), llms: tuple[str, ...] = ()) -> dict[str, str]:
    """Make sure the named policies are converted, the LLMs assembled and the embedder present; returns what
    was found/done."""
    report = {"embedder_dir": str(packaged_minilm())}
    for name in llms:
        start = time.perf_counter()
        report[f"{name}_gguf"] = f"{llm_gguf(name)} ({time.perf_counter() - start:.1f} s)"
    for name in policies:
        if name not in PACKAGED_POLICIES:
            raise ModelNotPreparedError(f"no packaged policy {name!r}; choose from {', '.join(PACKAGED_POLICIES)}")
        target = packaged_model_dir(name)
        report[f"{name}_dir"] = str(target)
        if is_prepared(target) and not force:
            report[name] = "already prepared"
            continue
        packaged = PACKAGED_POLICIES[name]
        gguf = packaged_gguf(name)
        seconds = convert_gguf(gguf, target, packaged.chat_template, packaged.eos_token)
        if packaged.assembled:
            gguf.unlink()  # the wheel can assemble it again; the converted folder is what loads
        if not is_prepared(target):
            raise ModelNotPreparedError(f"conversion into {target} did not produce a complete model folder")
        report[name] = f"converted in {seconds:.1f} s"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="convert again even if the cache is complete")
    parser.add_argument("--policy", action="append", choices=sorted(PACKAGED_POLICIES),
                        help=f"a packaged policy to prepare (repeatable; default {DEFAULT_POLICY})")
    parser.add_argument("--llm", action="append", choices=sorted(LLM_MODELS), default=[],
                        help="a packaged LLM whose GGUF to assemble and verify (repeatable)")
    parser.add_argument("--requirements", action="store_true", help="print the pins of the LLMs' part wheels and exit")
    args = parser.parse_args(argv)
    if args.requirements:
        print(" ".join(r for name in (args.llm or LLM_MODELS) for r in LLM_MODELS[name].requirements()))
        return 0
    start = time.perf_counter()
    try:
        report = prepare(force=args.force, policies=tuple(args.policy or (DEFAULT_POLICY,)), llms=tuple(args.llm))
    except ModelNotPreparedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, value in report.items():
        print(f"{key}: {value}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
