"""Convert GSM8K files you downloaded into hybridrl's prompt JSONL (for `data=jsonl reward=math`).

    python scripts/convert_gsm8k.py --input train.jsonl --output data/gsm8k_train.jsonl
    python scripts/convert_gsm8k.py --input test-00000-of-00001.parquet --output data/gsm8k_test.jsonl

Input: the original `train.jsonl`/`test.jsonl` or the Hugging Face parquet files (needs pyarrow), with columns
`question` and `answer`, where `answer` is a worked solution ending in `#### <number>`.
Output, one object per line:
    {"prompt": "<question> <instruction>", "answer": "72", "solution": "<the original answer text>"}
`answer` is the text after the last `####` with thousands commas removed, kept as a string (exact, and what
the math reward parses). Rows that cannot be converted are skipped and counted by reason; a JSON summary goes
to stdout. An existing output is never overwritten without --force, and never when it is the input. Standalone:
needs only the standard library (plus pyarrow for parquet), so it runs without hybridrl installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


class ConvertError(Exception):
    """A problem with the arguments or input files; printed as one line, exit code 2."""


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield (1-based row number, row) from a JSONL or parquet file; a bad JSON line yields its error text."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConvertError(
                f"{path} is parquet, which needs pyarrow: pip install pyarrow (or pass the .jsonl version)"
            ) from None
        try:
            table = pq.read_table(path)
        except Exception as e:  # ArrowInvalid etc.: a corrupt or non-parquet file
            raise ConvertError(f"cannot read {path} as parquet: {e}") from e
        missing = {"question", "answer"} - set(table.column_names)
        if missing:
            raise ConvertError(f"{path} lacks column(s) {sorted(missing)}; it has {table.column_names}")
        for i, row in enumerate(table.select(["question", "answer"]).to_pylist(), 1):
            yield i, row
        return
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, ValueError(f"invalid JSON ({e.msg})")


def convert_row(row: Any, instruction: str) -> dict[str, str] | str:
    """The output object for one GSM8K row, or the reason (a short string) it is skipped."""
    if isinstance(row, ValueError):
        return str(row)
    if not isinstance(row, dict):
        return "not a JSON object"
    question, solution = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
        return "missing or empty 'question'"
    if not isinstance(solution, str) or not solution.strip():
        return "missing or empty 'answer'"
    if "####" not in solution:
        return "'answer' has no '####' marker"
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        return "nothing after '####'"
    prompt = f"{question.strip()} {instruction}" if instruction else question.strip()
    return {"prompt": prompt, "answer": final, "solution": solution}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description="Convert GSM8K (jsonl or parquet) to hybridrl prompt JSONL.")
    p.add_argument("--input", required=True, type=Path, help="GSM8K train/test .jsonl or .parquet file")
    p.add_argument("--output", required=True, type=Path, help="JSONL file to write")
    p.add_argument("--instruction", default=DEFAULT_INSTRUCTION, help="text appended to each question ('' for none)")
    p.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    return p.parse_args(argv)


def convert(args: argparse.Namespace) -> dict[str, Any]:
    """Write the output file atomically and return the summary; raises ConvertError on bad arguments/input."""
    src, dst = args.input, args.output
    if not src.is_file():
        raise ConvertError(f"--input {src} does not exist or is not a file")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ConvertError(f"--output {dst} is the input file; write to another path")
    if dst.exists() and not args.force:
        raise ConvertError(f"--output {dst} exists; pass --force to overwrite it, or choose another path")
    written, reasons, examples = 0, Counter(), {}
    dst.parent.mkdir(parents=True, exist_ok=True)
    # Write next to the target and rename at the end, so a failure never leaves a half file at --output.
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for lineno, row in read_rows(src):
                result = convert_row(row, args.instruction)
                if isinstance(result, str):
                    reasons[result] += 1
                    examples.setdefault(result, lineno)
                    continue
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                written += 1
        if written == 0:
            raise ConvertError(f"no row of {src} could be converted (skipped: {dict(reasons)}); nothing written")
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return {
        "input": str(src),
        "output": str(dst),
        "rows_written": written,
        "rows_skipped": sum(reasons.values()),
        "skipped": {r: {"count": n, "first_row": examples[r]} for r, n in reasons.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry: prints the JSON summary and returns 0, or prints `error: ...` to stderr and returns 2."""
    args = parse_args(argv)
    try:
        summary = convert(args)
    except (ConvertError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
