"""Verification rules behind one interface (`base.Verifier`): exact greedy and sampling (`exact`), and the lossy,
opt-in arbitrated rules (`arbitrated`: CoSpec, FLy, typical acceptance)."""

from .base import FirstToken, StepInputs, Verifier
from .exact import (DeviceAcceptance, DeviceChoice, ExactVerifier, NodeContexts, RootContexts, batch_choices,
                    choices_apply, device_choice, greedy_device, greedy_walk, process_tree_logits, row_processors,
                    verify_at_once, verify_greedy, verify_keyed, verify_sampling)

__all__ = ["Verifier", "FirstToken", "StepInputs", "ExactVerifier", "process_tree_logits", "verify_greedy",
           "verify_sampling", "verify_keyed", "greedy_walk", "greedy_device", "DeviceAcceptance", "row_processors",
           "batch_choices", "choices_apply", "NodeContexts", "RootContexts", "DeviceChoice", "device_choice",
           "verify_at_once", "make_verifier"]


def make_verifier(config, do_sample: bool, drafter) -> Verifier:
    """The rule `config.verification` names, for one request (`registry.VERIFICATIONS`)."""
    from ..registry import VERIFICATIONS

    return VERIFICATIONS.get(config.verification)(config, do_sample, drafter)
