"""The cluster's routing map (`serving.affinity.PrefixAffinity`), and the install staying light: the package does not
import Ray (the `[cluster]` extra) unless a cluster is asked for."""

import subprocess
import sys

import pytest

from hf_hybrid_spec.serving.affinity import PrefixAffinity


def test_prefix_affinity_finds_the_replica_of_the_longest_shared_prefix():
    affinity = PrefixAffinity(block=4)
    first = list(range(10))  # two whole blocks
    affinity.record(first, "a")
    assert affinity.lookup(first + [50, 51, 52, 53]) == ("a", 8)  # a follow-up: its first two blocks are a's
    assert affinity.lookup([0, 1, 2, 3, 9, 9, 9, 9]) == ("a", 4)  # shares the first block only
    assert affinity.lookup([1, 2, 3, 4]) == (None, 0)
    affinity.record(first + [50, 51, 52, 53, 54], "b")  # the longer prompt went to b: b holds more
    assert affinity.lookup(first + [50, 51, 52, 53, 60]) == ("b", 12)
    # each key remembers the replica that served it last: with b gone, nobody is known to hold those blocks
    assert affinity.lookup(first + [50, 51, 52, 53], alive=["a"]) == (None, 0)
    affinity.record([7, 7], "c", session="s1")  # shorter than a block: the session alone keys it
    assert affinity.lookup([1, 1, 1, 1, 1], session="s1") == ("c", 0)
    affinity.forget("b")
    assert affinity.lookup(first + [50, 51, 52, 53, 60]) == (None, 0)
    assert affinity.lookup([1, 1, 1, 1, 1], session="s1") == ("c", 0)


def test_prefix_affinity_is_bounded():
    affinity = PrefixAffinity(block=2, max_keys=3)
    affinity.record([1, 2, 3, 4], "a")
    affinity.record([5, 6, 7, 8], "b")
    assert len(affinity) == 3
    assert affinity.lookup([5, 6, 7, 8]) == ("b", 4)
    with pytest.raises(ValueError):
        PrefixAffinity(block=0)


def test_importing_the_package_does_not_import_ray():
    code = "import sys, hf_hybrid_spec, hf_hybrid_spec.serving; print('ray' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_cli_refuses_fewer_than_one_replica(capsys):
    from hf_hybrid_spec.serving.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["--model", "unused", "--replicas", "0"])
    assert exit_.value.code == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
