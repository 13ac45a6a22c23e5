"""Built-in prompt sets for benchmarks, written for this project (no third-party sources).

`code_prompts()` are beginnings of Python files and functions of the kind a code model continues: utilities,
classes, tests, command-line tools. The trained fixtures saw scientific-Python code, so these read like it,
but none is taken from networkx, sympy or pandas (kept out of the fixtures' training data for evaluation).
"""

from __future__ import annotations

__all__ = ["code_prompts", "PROMPT_SETS"]

_CODE = [
    'import numpy as np\n\n\ndef moving_average(x, window):\n    """Return the moving average of `x` over `window` samples."""\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    'import argparse\n\n\ndef parse_args():\n    parser = argparse.ArgumentParser(description="Train a model")\n    parser.add_argument("--lr", type=float, default=1e-3)\n    parser.add_argument("--epochs", type=int, default=10)\n',
    'def normalize(v, axis=-1, eps=1e-12):\n    """Scale `v` to unit length along `axis`."""\n    norm = np.sqrt(np.sum(v * v, axis=axis, keepdims=True))\n',
    "import os\nimport json\n\n\ndef load_config(path):\n    with open(path) as f:\n        config = json.load(f)\n",
    'class Matrix:\n    """A small dense matrix of floats."""\n\n    def __init__(self, rows, cols):\n        self.rows = rows\n        self.cols = cols\n        self.data = [[0.0] * cols for _ in range(rows)]\n\n    def __getitem__(self, index):\n',
    "import numpy as np\nfrom numpy.testing import assert_allclose\n\n\ndef test_dot_product():\n    a = np.array([1.0, 2.0, 3.0])\n    b = np.array([4.0, 5.0, 6.0])\n",
    'def binary_search(values, target):\n    """Index of `target` in the sorted list `values`, or -1."""\n    lo, hi = 0, len(values) - 1\n    while lo <= hi:\n',
    "from dataclasses import dataclass\n\n\n@dataclass\nclass TrainingConfig:\n    learning_rate: float = 1e-3\n    batch_size: int = 32\n",
    'import logging\n\nlogger = logging.getLogger(__name__)\n\n\ndef retry(func, attempts=3):\n    """Call `func` until it succeeds, at most `attempts` times."""\n    for attempt in range(attempts):\n',
    "import numpy as np\n\n\ndef rotation_matrix(theta):\n    c, s = np.cos(theta), np.sin(theta)\n",
    'def read_csv_rows(path, delimiter=","):\n    rows = []\n    with open(path) as handle:\n        header = handle.readline().strip().split(delimiter)\n',
    "class Node:\n    def __init__(self, value, left=None, right=None):\n        self.value = value\n        self.left = left\n        self.right = right\n\n\ndef inorder(node):\n",
    'import numpy as np\n\n\ndef gaussian_kernel(size, sigma=1.0):\n    """Return a normalized 2D Gaussian kernel of shape (size, size)."""\n    ax = np.arange(size) - (size - 1) / 2.0\n',
    "def flatten(nested):\n    result = []\n    for item in nested:\n        if isinstance(item, (list, tuple)):\n",
    "import unittest\n\n\nclass TestStack(unittest.TestCase):\n    def setUp(self):\n        self.stack = Stack()\n\n    def test_push(self):\n        self.stack.push(1)\n        self.assertEqual(self.stack.items, [1])\n\n    def test_pop(self):\n",
    'def chunks(seq, size):\n    """Yield successive `size`-long chunks of `seq`."""\n',
    "import numpy as np\n\n\ndef euclidean_distance(a, b):\n    return np.sqrt(np.sum((a - b) ** 2))\n\n\ndef manhattan_distance(a, b):\n",
    'class Timer:\n    """Context manager that measures elapsed wall time."""\n\n    def __enter__(self):\n        self.start = time.perf_counter()\n        return self\n\n    def __exit__(self, *exc):\n',
    "def merge_sorted(a, b):\n    i = j = 0\n    out = []\n    while i < len(a) and j < len(b):\n",
    'import numpy as np\n\n\ndef linear_regression(x, y):\n    """Least-squares fit of y = a * x + b; returns (a, b)."""\n    x = np.asarray(x, dtype=float)\n    y = np.asarray(y, dtype=float)\n',
    "def parse_version(text):\n    parts = text.strip().split(\".\")\n",
    'class Counter:\n    def __init__(self):\n        self.counts = {}\n\n    def add(self, key, amount=1):\n        self.counts[key] = self.counts.get(key, 0) + amount\n\n    def most_common(self, n=None):\n',
    "import numpy as np\n\n\ndef softmax(x, axis=-1):\n    x = x - np.max(x, axis=axis, keepdims=True)\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n',
    "import os\n\n\ndef find_files(root, suffix):\n    matches = []\n    for dirpath, dirnames, filenames in os.walk(root):\n",
    'def validate_shape(array, ndim, name="array"):\n    if array.ndim != ndim:\n        raise ValueError(\n',
    "import numpy as np\n\n\nclass RunningStats:\n    def __init__(self):\n        self.n = 0\n        self.mean = 0.0\n        self.m2 = 0.0\n\n    def update(self, x):\n",
    'def setup_logging(level="INFO"):\n    import logging\n\n    logging.basicConfig(\n',
    "def transpose(matrix):\n    return [list(row) for row in zip(*matrix)]\n\n\ndef identity(n):\n",
    'def clip(value, lower, upper):\n    """Clamp `value` to [lower, upper]."""\n    if lower > upper:\n        raise ValueError("lower must not exceed upper")\n',
    "import numpy as np\n\n\ndef histogram(data, bins=10):\n    data = np.asarray(data)\n    lo, hi = data.min(), data.max()\n",
]

PROMPT_SETS = {"code": _CODE}


def code_prompts(n: int | None = None) -> list[str]:
    """The first `n` built-in code prompts (all of them by default)."""
    return list(_CODE if n is None else _CODE[:n])
