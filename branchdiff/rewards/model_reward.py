"""What every reward backed by a neural network shares: batching, no gradients, 8-bit images, and
loading weights from a local path or a hub id with one clear line when they are missing.

Images are scored as the 8-bit pictures a user saves and a reference scorer reads back:
`to_uint8` rounds `images · 255` (as diffusers' `numpy_to_pil` does) before any preprocessing, so
a score computed in training equals the score of the saved PNG.

Weights come from a LOCAL PATH or a HUB ID (downloaded and cached by huggingface_hub; online users
only). Nothing is unpickled beyond tensors: checkpoint files are read with safetensors or
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import importlib
import re
from abc import abstractmethod
from pathlib import Path
from types import ModuleType

import torch

from branchdiff.rewards.base import Reward, to_uint8  # noqa: F401  (to_uint8: the rewards below import it from here)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "owner/name", the form of a hub repo id


class MissingWeightsError(FileNotFoundError):
    """A reward's weights are neither a local path nor reachable on the hub; the message is one line
    naming what was asked for and where to get it."""


CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's image statistics (HPS, ImageReward normalise with them)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def resolve_weight_file(source: str | Path, filename: str, *, reward: str, origin: str) -> Path:
    """The local path of one weight file.

    Args:
        source: a local file; a local folder holding `filename`; or a hub repo id ("owner/name") from
            which `filename` is downloaded (cached by huggingface_hub, online only).
        filename: the file's name in a folder or hub repo (e.g. "HPS_v2.1_compressed.pt").
        reward: the reward's name, for the error message.
        origin: where a user gets the file, for the error message (e.g. a hub URL and file name).

    Raises:
        MissingWeightsError: one line naming `source` and `origin`.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if (path / filename).is_file():
            return path / filename
        raise MissingWeightsError(f"reward {reward!r}: folder {str(path)!r} holds no {filename}; get it from {origin}")
    if isinstance(source, str) and _HUB_ID.match(source):
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(source, filename))
        except Exception as error:  # offline, unknown repo or file, network: all mean "not available here"
            raise MissingWeightsError(
                f"reward {reward!r}: {source!r} is not a local path and {filename} could not be fetched from that hub "
                f"repo ({type(error).__name__}; offline?); download it from {origin} and pass its local path"
            ) from error
    raise MissingWeightsError(f"reward {reward!r}: no weights at {str(source)!r}; download {filename} from {origin} and pass its local path")


def load_pretrained(loader, source: str | Path, *, reward: str, what: str, origin: str):
    """`loader(source)` (a transformers `from_pretrained`), with a one-line MissingWeightsError naming
    `source` and `origin` when it is neither a local folder nor a reachable hub id."""
    expanded = Path(source).expanduser()
    try:
        return loader(str(expanded) if expanded.exists() else str(source))
    except (OSError, ValueError) as error:  # transformers raises OSError (not found, offline) or HFValidationError (a ValueError)
        raise MissingWeightsError(
            f"reward {reward!r}: cannot load the {what} from {str(source)!r} ({first_line(error)}); pass a local folder "
            f"written by save_pretrained or a hub id reachable online, e.g. {origin}"
        ) from error


def import_optional(module: str, *, reward: str, package: str, install: str) -> ModuleType:
    """Import `module` of the optional pip `package`, or raise one ImportError line naming the
    install command."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name != module and not module.startswith(f"{error.name}."):
            raise ImportError(f"reward {reward!r}: the package {package!r} is installed but cannot import {error.name!r}: {install}") from error
        raise ImportError(f"reward {reward!r} needs the optional package {package!r}, which is not installed: {install}") from error
    except ImportError as error:  # installed, but broken against this environment's versions
        raise ImportError(f"reward {reward!r}: the package {package!r} is installed but fails to import "
                          f"({' '.join(str(error).split())}); {install}") from error


def load_tensor_file(path: Path, *, reward: str) -> dict[str, torch.Tensor]:
    """A state dict from a .safetensors file, or from a torch file read with `weights_only=True`
    (tensors and plain containers only; anything else is refused, never unpickled)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle.UnpicklingError for objects beyond tensors; RuntimeError for a damaged file
        raise ValueError(f"reward {reward!r}: {str(path)!r} is not a plain tensor checkpoint readable with weights_only=True ({first_line(error)})") from error


class ModelReward(Reward):
    """A reward that runs a model on chunks of `batch_size` images, in eval mode, without gradients.

    Subclasses implement `score_chunk(images, prompts) -> (b,)` for images already on `self.device`.
    """

    def __init__(self, device: str | torch.device = "cpu", batch_size: int = 16) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.device = torch.device(device)
        self.batch_size = batch_size

    @abstractmethod
    def score_chunk(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Scores (b,) of images (b, 3, H, W) in [0, 1] on `self.device` and their b prompts."""

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"reward {self.name!r} expects images of shape (B, 3, H, W), got {tuple(images.shape)}")
        if images.shape[0] != len(prompts):
            raise ValueError(f"reward {self.name!r} got {images.shape[0]} images for {len(prompts)} prompts")
        prompts = list(prompts)
        chunks = []
        with torch.no_grad():
            for start in range(0, len(prompts), self.batch_size):
                chunk = images[start : start + self.batch_size].to(self.device, torch.float32)  # (b, 3, H, W)
                chunks.append(self.score_chunk(chunk, prompts[start : start + self.batch_size]).float().cpu())
        return torch.cat(chunks) if chunks else torch.zeros(0)
