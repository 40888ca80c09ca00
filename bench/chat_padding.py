"""How much of a batch of padded examples is padding: gpt2.data.ExampleLoader's rows (one
example a row of T positions, cut to T+1 tokens, padded after it) over an instruction
sample with a real length distribution, at several T.

The sample needs no download: every function of the Python standard library with a
docstring becomes a {"prompt": its signature and docstring, "completion": its body}
record, tokenized as bytes (so T counts bytes).  Prints, per T: the examples kept,
truncated and dropped, the share of the (B, T) positions that are padding and the share
whose target is trained, then the share that is padding in training batches of B = 1, 4
and 16 as the loader makes them (each as wide as its longest example, examples of like
lengths grouped): what is computed for nothing.  Writes nothing.

    python bench/chat_padding.py [--max-examples 5000] [-T 256,512,1024,2048]
"""
import argparse
import ast
import json
import os
import sys
import tempfile

import _paths  # noqa: F401  (the in-place build first)

from gpt2 import data


def stdlib_functions(max_examples):
    """{"prompt", "completion"} of up to ``max_examples`` stdlib functions with docstrings,
    in sorted file order."""
    root, files = data.stdlib_source_files()
    records = []
    for rel in files:
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = node.body[0] if node.body else None
            if ast.get_docstring(node) is None or len(node.body) < 2:
                continue
            head = "".join(lines[node.lineno - 1:doc.end_lineno])
            body = "".join(lines[doc.end_lineno:node.end_lineno])
            records.append({"prompt": head, "completion": body})
            if len(records) == max_examples:
                return records
    return records


BATCHES = (1, 4, 16)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=5000)
    p.add_argument("-T", default="256,512,1024,2048",
                   help="sequence lengths, comma-separated (default: %(default)s)")
    args = p.parse_args(argv)
    records = stdlib_functions(args.max_examples)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        examples = data.read_data(f.name)
    lengths = sorted(examples.lengths())
    print(f"{len(examples):,} stdlib functions as prompt/completion (bytes): median "
          f"{lengths[len(lengths) // 2]:,} tokens, 90th percentile "
          f"{lengths[9 * len(lengths) // 10]:,}")
    print(f"{'T':>6} {'kept':>7} {'truncated':>10} {'dropped':>8} {'padding':>8} {'trained':>8}"
          + "".join(f" {'B=' + str(b) + ' batches':>12}" for b in BATCHES))
    for T in (int(t) for t in args.T.split(",")):
        loader = data.ExampleLoader(examples, 1, T, 256, split="all", shuffle=False)
        # Training batches: as wide as their longest example, examples of like lengths
        # grouped (shuffled order, epoch 0).
        batched = [data.ExampleLoader(examples, b, T, 256, split="all").batch_padding_fraction()
                   for b in BATCHES]
        print(f"{T:>6} {loader.num_windows:>7,} {loader.truncated:>10,} {loader.dropped:>8,} "
              f"{100 * loader.padding_fraction:>7.1f}% {100 * loader.trained_fraction:>7.1f}%"
              + "".join(f" {100 * f:>11.1f}%" for f in batched))
    return 0


if __name__ == "__main__":
    sys.exit(main())
