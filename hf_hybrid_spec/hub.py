"""Hub format helpers shared by the package's small trained models (CoSpec arbiter, HVD payoff predictor)."""

from __future__ import annotations

import os


class ModelCardMixin:
    """For a `PreTrainedModel` with a `model_card() -> str`: `save_pretrained` writes the card as README.md first,
    so a `push_to_hub` (which saves, then uploads the folder) publishes it with the weights."""

    def model_card(self) -> str:
        raise NotImplementedError

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, "README.md"), "w") as f:
            f.write(self.model_card())
        return super().save_pretrained(save_directory, *args, **kwargs)
