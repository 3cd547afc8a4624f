"""`python -m memalpha.models.prepare`: convert the packaged GGUF default policy into a plain cached HF
folder once and check the packaged MiniLM embedder is present. Idempotent; fast when already done."""

from __future__ import annotations

import argparse
import sys
import time

from memalpha.models.loading import (
    ModelNotPreparedError,
    convert_gguf,
    default_model_dir,
    is_prepared,
    packaged_gguf,
    packaged_minilm,
)


def prepare(force: bool = False) -> dict[str, str]:
    """Make sure the default model is converted and the embedder present; returns what was found/done."""
    target = default_model_dir()
    report = {"policy_dir": str(target), "embedder_dir": str(packaged_minilm())}
    if is_prepared(target) and not force:
        report["policy"] = "already prepared"
        return report
    seconds = convert_gguf(packaged_gguf(), target)
    if not is_prepared(target):
        raise ModelNotPreparedError(f"conversion into {target} did not produce a complete model folder")
    report["policy"] = f"converted in {seconds:.1f} s"
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--force", action="store_true", help="convert again even if the cache is complete")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        report = prepare(force=args.force)
    except ModelNotPreparedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for key, value in report.items():
        print(f"{key}: {value}")
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
