"""Import time of the package against transformers', each in a fresh interpreter, median of `--runs`.

    python benchmarks/import_time.py --runs 5

Rows: `import transformers` (lazy: what a bare import costs), `import hf_hybrid_spec` (should cost at most ~1 s more),
`import transformers.generation.utils` (what any `model.generate` loads) and
`from hf_hybrid_spec import AssistantConfig, speculative_generate` (the quickstart's import: should cost little more
than the generation code it needs). The first row of each pair is the reference, in the same run. A JSON line last.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time

from hf_hybrid_spec.cli import argument_parser

STATEMENTS = {
    "import transformers": "import transformers",
    "import hf_hybrid_spec": "import hf_hybrid_spec",
    "import transformers.generation.utils": "import transformers.generation.utils",
    "from hf_hybrid_spec import AssistantConfig, speculative_generate":
        "from hf_hybrid_spec import AssistantConfig, speculative_generate",
}


def seconds(statement: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(__doc__)
    parser.add_argument("--runs", type=int, default=5, help="fresh interpreters per statement (median reported)")
    args = parser.parse_args(argv)
    seconds("import torch, transformers")  # warm the file cache once, untimed
    # Interleaved, so that a machine getting busier or quieter shifts every row alike.
    times: dict[str, list[float]] = {name: [] for name in STATEMENTS}
    for _ in range(args.runs):
        for name, statement in STATEMENTS.items():
            times[name].append(seconds(statement))
    medians = {name: statistics.median(v) for name, v in times.items()}
    width = max(map(len, STATEMENTS))
    print(f"{'statement':<{width}}  median s  (of {args.runs})")
    for name, value in medians.items():
        print(f"{name:<{width}}  {value:8.2f}")
    over_bare = medians["import hf_hybrid_spec"] - medians["import transformers"]
    over_generate = (medians["from hf_hybrid_spec import AssistantConfig, speculative_generate"]
                     - medians["import transformers.generation.utils"])
    print(f"import hf_hybrid_spec over import transformers: {over_bare:+.2f} s; the quickstart import over "
          f"transformers' generation code: {over_generate:+.2f} s")
    print(json.dumps(dict(bench="import_time", runs=args.runs, medians={k: round(v, 3) for k, v in medians.items()},
                          over_transformers_s=round(over_bare, 3), over_generation_s=round(over_generate, 3))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
