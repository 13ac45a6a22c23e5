"""The command lines a user meets first: every recipe's and the server's `--help` shows the defaults and answers
before torch is imported, `--version` names the versions, a bad option exits 2."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (REPO / "recipes").glob("*.py"))
# Runs a script as `python <script> <args>` would, then reports whether torch was imported on the way.
_RUN = """
import runpy, sys
script, *args = sys.argv[1:]
sys.argv = [script, *args]
try:
    runpy.run_path(script, run_name="__main__")
except SystemExit as exit:
    code = exit.code
else:
    code = 0
print("torch imported:", "torch" in sys.modules)
sys.exit(code)
"""


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _RUN, script, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_help_shows_defaults_before_torch_loads(recipe):
    result = run(str(REPO / "recipes" / recipe), "--help")
    assert result.returncode == 0, result.stderr
    assert "(default: " in result.stdout and "--version" in result.stdout
    assert "torch imported: False" in result.stdout
    version = run(str(REPO / "recipes" / recipe), "--version")
    assert version.returncode == 0 and version.stdout.startswith("hf_hybrid_spec ")
    assert "transformers " in version.stdout
    bad = run(str(REPO / "recipes" / recipe), "--no-such-option")
    assert bad.returncode == 2 and "error:" in bad.stderr
    assert "torch imported: False" in bad.stdout


def test_recipe_help_cites_files_that_exist():
    import re

    for recipe in RECIPES:
        text = (REPO / "recipes" / recipe).read_text()
        for cited in re.findall(r"recipes/configs/[\w.-]+\.yaml", text):
            assert (REPO / cited).is_file(), f"{recipe} cites {cited}, which does not exist"


def test_server_help_and_version():
    from hf_hybrid_spec.serving.cli import main

    with pytest.raises(SystemExit) as exit:
        main(["--help"])
    assert exit.value.code == 0
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
