"""A toy verification rule: the whole of a new rule, one file and one registration line (tests/integration/test_layering.py).
It is greedy verification, counted."""

from hf_hybrid_spec.registry import register_verification
from hf_hybrid_spec.verification import ExactVerifier

CALLS = {"first_token": 0, "verify": 0}


class CountingGreedy(ExactVerifier):
    def __init__(self):
        super().__init__(do_sample=False)

    def first_token(self, scores, inputs):
        CALLS["first_token"] += 1
        return super().first_token(scores, inputs)

    def verify(self, tree, scores, inputs):
        CALLS["verify"] += 1
        return super().verify(tree, scores, inputs)


register_verification("toy_greedy", lambda config, do_sample, drafter: CountingGreedy())
