"""`ocr`: the text-rendering reward of Flow-GRPO (Liu et al., arXiv 2505.05470): how much of the text a
prompt asks for an OCR engine reads in the image.

    t = the prompt's text between its first two double quotes ("..."), lower-cased, spaces removed
    r = every line the engine reads with confidence > `min_confidence`, joined in its order, normalised alike
    d = 0 if t is a substring of r, else the edit (Levenshtein) distance between r and t
    ocr = 1 − min(d, |t|) / |t|                      in [0, 1]; 1 when the text is there, whatever else is

The same as Flow-GRPO's public `ocr.py` but for three cases it leaves undefined: a prompt without quotes
targets the whole prompt (its code raises there), an empty target scores 1 when nothing is read and 0
otherwise (its code divides by zero), and an engine error stops the run with its message instead of
scoring 0 (a broken engine would otherwise look like unreadable images).

The engine is RapidOCR (`rapidocr-onnxruntime`: PaddleOCR's PP-OCRv4 detection and recognition models
as ONNX, shipped inside its wheel, so the reward runs offline): `pip install 'branchdiff-rl[ocr]'`; it
runs on the CPU. `engine: paddleocr` uses PaddleOCR 3 itself where it is installed (English detection
and recognition, its models fetched on first use); Flow-GRPO scores with PaddleOCR 2's English models,
whose API PaddleOCR 3 replaced, so neither engine is its exact setup. Either is given each image as
8-bit BGR pixels (their convention for arrays).
"""

from __future__ import annotations

from typing import Any

import torch

from branchdiff.rewards.base import to_uint8


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and substitutions turning
    `a` into `b` (Wagner–Fischer, one row at a time)."""
    previous = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def target_text(prompt: str) -> str:
    """The text a prompt asks to render: between its first two double quotes (the whole prompt without them)."""
    parts = prompt.split('"')
    return parts[1] if len(parts) > 2 else prompt


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def text_score(read: str, target: str) -> float:
    """1 − min(d, |t|) / |t| of the module doc, both texts normalised here."""
    read, target = normalise(read), normalise(target)
    if not target:
        return float(not read)
    distance = 0 if target in read else edit_distance(read, target)
    return 1.0 - min(distance, len(target)) / len(target)


ENGINES = ("rapidocr", "paddleocr")


class OCRReward:
    name = "ocr"
    scale = "1 − min(edit distance, |target|) / |target| in [0, 1]: the prompt's quoted text against what OCR reads (case and spaces ignored)"

    def __init__(self, device: str | torch.device = "cpu", min_confidence: float = 0.0, engine: str = "rapidocr") -> None:
        if engine not in ENGINES:
            raise ValueError(f"reward 'ocr': engine={engine!r} must be one of {', '.join(ENGINES)}")
        if not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"reward 'ocr': min_confidence = {min_confidence} must lie in [0, 1)")
        self.device = torch.device("cpu")  # RapidOCR's ONNX sessions run on the CPU, whatever `device` the run names
        self.min_confidence, self.engine_name = min_confidence, engine
        self.engine = rapidocr_engine() if engine == "rapidocr" else paddleocr_engine()

    def read(self, pixels: Any) -> str:
        """The text the engine reads in one (H, W, 3) uint8 RGB array, its lines joined in its order."""
        bgr = pixels[:, :, ::-1].copy()  # both engines take arrays as OpenCV's BGR
        if self.engine_name == "rapidocr":
            lines, _ = self.engine(bgr)
            read = [(text, confidence) for _, text, confidence in lines or []]
        else:
            read = [pair for result in self.engine.predict(bgr) for pair in zip(result["rec_texts"], result["rec_scores"])]
        return "".join(text for text, confidence in read if float(confidence) > self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        pixels = to_uint8(images).permute(0, 2, 3, 1).numpy()  # (B, H, W, 3)
        return torch.tensor([text_score(self.read(image), target_text(prompt)) for image, prompt in zip(pixels, prompts)])


def rapidocr_engine() -> Any:
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise ImportError("reward 'ocr' needs rapidocr-onnxruntime: pip install 'branchdiff-rl[ocr]'") from None
    return RapidOCR()


def paddleocr_engine() -> Any:
    """PaddleOCR 3's English text pipeline, detection and recognition only (no document unwarping or orientation models)."""
    try:
        from paddleocr import PaddleOCR
    except ImportError:
        raise ImportError("reward 'ocr' with engine: paddleocr needs PaddleOCR 3 and PaddlePaddle: pip install paddlepaddle paddleocr "
                          "(or the default engine, rapidocr, which ships its models)") from None
    if not hasattr(PaddleOCR, "predict"):
        raise ImportError("reward 'ocr' with engine: paddleocr needs PaddleOCR ≥ 3 (its predict API): pip install -U paddleocr")
    return PaddleOCR(lang="en", use_doc_orientation_classify=False, use_doc_unwarping=False, use_textline_orientation=False)
