"""Hub format helpers shared by the package's loadable objects (configs, drafters, arbiters, predictors).

- `resolve_source`: a local path or a Hub repository id, told apart before anything is downloaded, so that a
  mistyped local path fails at once with "no such file or directory" (huggingface_hub would otherwise retry the
  network for tens of seconds, or complain about the form of a repository id).
- `LocalFirstMixin`: `from_pretrained` of a `PreTrainedModel` checked through `resolve_source` first.
- `ModelCardMixin`: `save_pretrained` also writes the model card.
- `files_as_umask`: files a save wrote with owner-only permissions (transformers' `save_pretrained` writes its
  safetensors shards 0600) given the modes the process's umask asks for, as every other file of the folder has.
"""

from __future__ import annotations

import os

__all__ = ["resolve_source", "LocalFirstMixin", "ModelCardMixin", "files_as_umask"]

# Endings of files the package loads: a name ending so is a path, never a repository id.
_FILE_ENDINGS = (".json", ".safetensors", ".bin", ".pt", ".pth", ".yaml", ".yml")


def _looks_local(path: str) -> bool:
    return (os.path.isabs(path) or path in (".", "..") or path.startswith(("./", "../", "~", ".\\", "..\\"))
            or "\\" in path or path.count("/") > 1 or path.endswith(_FILE_ENDINGS))


def resolve_source(path_or_repo_id: str | os.PathLike, what: str) -> str:
    """`path_or_repo_id` as a string, checked: an existing local path, or a valid Hub repository id ("org/name").

    Raises FileNotFoundError for anything else (a local-looking path that does not exist, or a string that cannot
    be a repository id); `what` names the object in the message ("assistant config", "EAGLE drafter", ...).
    """
    path = os.fspath(path_or_repo_id)
    if os.path.exists(path):
        return path
    if _looks_local(path):
        raise FileNotFoundError(f"{what}: no such file or directory: {path!r}")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise FileNotFoundError(f"{what}: {path!r} is neither an existing local path nor a Hub repository id "
                                "(org/name)") from None
    return path


def files_as_umask(directory: str | os.PathLike) -> None:
    """Give the weight files in `directory` (`*.safetensors`, `*.bin` and their index; not its subfolders) the mode
    a new file gets under the process's umask (0644 under the usual 022), where they were written narrower."""
    mask = os.umask(0)
    os.umask(mask)
    wanted = 0o666 & ~mask
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False) and entry.name.endswith((".safetensors", ".bin", ".index.json")):
            mode = entry.stat().st_mode & 0o777
            if mode & wanted != wanted:
                os.chmod(entry.path, mode | wanted)


class LocalFirstMixin:
    """For a `PreTrainedModel`: `from_pretrained` fails at once, clearly, on a local path that does not exist."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        source = resolve_source(pretrained_model_name_or_path, cls.__name__)
        return super().from_pretrained(source, *args, **kwargs)


class ModelCardMixin:
    """For a `PreTrainedModel` with a `model_card() -> str`: `save_pretrained` writes the card as README.md first,
    so a `push_to_hub` (which saves, then uploads the folder) publishes it with the weights."""

    def model_card(self) -> str:
        raise NotImplementedError

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        os.makedirs(save_directory, exist_ok=True)
        with open(os.path.join(save_directory, "README.md"), "w") as f:
            f.write(self.model_card())
        result = super().save_pretrained(save_directory, *args, **kwargs)
        files_as_umask(save_directory)
        return result
