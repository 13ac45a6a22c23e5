"""The target checkpoint's own multi-token-prediction head as a drafter (`AssistantConfig(drafter="mtp")`)."""

from .drafter import MtpDrafter
from .modeling import MtpHead, load_mtp_state, mtp_layer_count, save_mtp_state

__all__ = ["MtpDrafter", "MtpHead", "load_mtp_state", "mtp_layer_count", "save_mtp_state"]
