"""`ocr`: the text-rendering reward of Flow-GRPO (Liu et al., arXiv 2505.05470): how much of the text a
prompt asks for an OCR engine reads in the image.

    t = the prompt's text after its first double quote, up to the next one (or the end), lower-cased, spaces removed
    r = every line the engine reads with confidence ≥ `min_confidence`, joined in its order, normalised alike
    d = 0 if t is a substring of r, else the edit (Levenshtein) distance between r and t
    ocr = 1 − min(d, |t|) / |t|                      in [0, 1]; 1 when the text is there, whatever else is

By default it reads as Flow-GRPO's public `ocr.py` reads, each difference a setting:
- `quotes: straight` takes the target as Flow-GRPO does (`prompt.split('"')[1]`: after the first straight
  double quote, up to the next or the end of the prompt); `quotes: any` reads curly quotes (“ ”) as straight ones.
- `angle_classifier: false`: the engine's text-angle classifier is off, as Flow-GRPO runs PaddleOCR
  (`use_angle_cls=False`, `cls=False`); with it on, upside-down text reads as upright.
- `channels: rgb` hands the engine the image's RGB pixels, as Flow-GRPO does (`np.array` of a PIL image),
  although both engines expect OpenCV's BGR for arrays; `channels: bgr` gives them BGR.
- `min_confidence: 0.5` keeps the lines PaddleOCR's own pipeline keeps (its `drop_score` 0.5; Flow-GRPO then
  keeps every line above 0); the value is handed to the engine, so any value in [0, 1) takes effect.
Three cases Flow-GRPO leaves undefined: a prompt without a straight double quote targets the whole prompt
(its code raises there; `check_prompts` warns when a prompt set holds such prompts), an empty target scores
1 when nothing is read and 0 otherwise (its code divides by zero), and an engine error stops the run with its
message instead of scoring 0 (a broken engine would otherwise look like unreadable images).

The engine is RapidOCR (`rapidocr-onnxruntime`: PaddleOCR's PP-OCRv4 detection and recognition models
as ONNX, shipped inside its wheel, so the reward runs offline): `pip install 'branchdiff-rl[ocr]'`; it
runs on the CPU. `engine: paddleocr` uses PaddleOCR 3 itself where it is installed (English detection
and recognition, its models fetched on first use); Flow-GRPO scores with PaddleOCR 2's English models,
whose API PaddleOCR 3 replaced, so neither engine is its exact setup.
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


QUOTE_RULES = ("straight", "any")
CURLY = str.maketrans({"\u201c": '"', "\u201d": '"'})  # “ ” read as " under quotes: any


def target_text(prompt: str, quotes: str = "straight") -> str:
    """The text a prompt asks to render (module doc): after its first double quote up to the next one or the end of
    the prompt, as Flow-GRPO splits it; the whole prompt when it holds no double quote. `quotes: any` reads “ ” as "."""
    parts = (prompt.translate(CURLY) if quotes == "any" else prompt).split('"')
    return parts[1] if len(parts) > 1 else prompt


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
CHANNELS = ("rgb", "bgr")


class OCRReward:
    """The `ocr` reward (module doc).

    Args:
        min_confidence: lines read with a lower confidence are left out (the engines' own default, 0.5).
        engine: rapidocr (PP-OCRv4 as ONNX, in its wheel) or paddleocr (PaddleOCR 3, where installed).
        angle_classifier: run the engine's text-angle classifier (Flow-GRPO: off).
        channels: the channel order handed to the engine, rgb (Flow-GRPO's) or bgr (the engines' own convention).
        quotes: straight (Flow-GRPO's rule) or any (curly quotes too) to find the prompt's target text.
    """

    name = "ocr"
    scale = "1 − min(edit distance, |target|) / |target| in [0, 1]: the prompt's quoted text against what OCR reads (case and spaces ignored)"

    def __init__(self, device: str | torch.device = "cpu", min_confidence: float = 0.5, engine: str = "rapidocr", angle_classifier: bool = False,
                 channels: str = "rgb", quotes: str = "straight") -> None:
        if engine not in ENGINES:
            raise ValueError(f"reward 'ocr': engine={engine!r} must be one of {', '.join(ENGINES)}")
        if isinstance(min_confidence, bool) or not isinstance(min_confidence, (int, float)) or not 0.0 <= min_confidence < 1.0:
            raise ValueError(f"reward 'ocr': min_confidence = {min_confidence!r} must be a number in [0, 1)")
        if not isinstance(angle_classifier, bool):
            raise ValueError(f"reward 'ocr': angle_classifier = {angle_classifier!r} must be true or false")
        if channels not in CHANNELS:
            raise ValueError(f"reward 'ocr': channels={channels!r} must be one of {', '.join(CHANNELS)}")
        if quotes not in QUOTE_RULES:
            raise ValueError(f"reward 'ocr': quotes={quotes!r} must be one of {', '.join(QUOTE_RULES)}")
        self.device = torch.device("cpu")  # RapidOCR's ONNX sessions run on the CPU, whatever `device` the run names
        self.min_confidence, self.engine_name, self.angle_classifier = float(min_confidence), engine, angle_classifier
        self.channels, self.quotes = channels, quotes
        self.engine = rapidocr_engine(angle_classifier, self.min_confidence) if engine == "rapidocr" else paddleocr_engine(angle_classifier)

    @staticmethod
    def check_prompts(prompts: list[str], quotes: str = "straight", **settings: object) -> str | None:
        """A warning when prompts of the set name no quoted text (they are scored against the whole prompt), else None."""
        unquoted = [number for number, prompt in enumerate(prompts, start=1)
                    if '"' not in (prompt.translate(CURLY) if quotes == "any" else prompt)]
        if not unquoted:
            return None
        curly = [n for n in unquoted if "\u201c" in prompts[n - 1] or "\u201d" in prompts[n - 1]]
        hint = f"; prompt {curly[0]} uses curly quotes (“ ”), which kwargs {{quotes: any}} reads" if curly and quotes != "any" else ""
        return (f"{len(unquoted)} of {len(prompts)} prompts (the first: prompt {unquoted[0]}) hold no text between double quotes, so "
                f"'ocr' scores them against the whole prompt; quote the text to render, e.g. a sign that reads \"OPEN\"{hint}")

    def read(self, pixels: Any) -> str:
        """The text the engine reads in one (H, W, 3) uint8 RGB array, its lines joined in its order."""
        image = pixels[:, :, ::-1].copy() if self.channels == "bgr" else pixels
        if self.engine_name == "rapidocr":
            lines, _ = self.engine(image, use_cls=self.angle_classifier, text_score=self.min_confidence)
            read = [(text, confidence) for _, text, confidence in lines or []]
        else:
            read = [pair for result in self.engine.predict(image) for pair in zip(result["rec_texts"], result["rec_scores"])]
        return "".join(text for text, confidence in read if float(confidence) >= self.min_confidence)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        pixels = to_uint8(images).permute(0, 2, 3, 1).numpy()  # (B, H, W, 3)
        return torch.tensor([text_score(self.read(image), target_text(prompt, self.quotes)) for image, prompt in zip(pixels, prompts)])


def rapidocr_engine(angle_classifier: bool = False, min_confidence: float = 0.5) -> Any:
    """RapidOCR with its angle classifier on or off and its own confidence cut at `min_confidence`."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise ImportError("reward 'ocr' needs rapidocr-onnxruntime: pip install 'branchdiff-rl[ocr]'") from None
    return RapidOCR(use_cls=angle_classifier, text_score=min_confidence)


def paddleocr_engine(angle_classifier: bool = False) -> Any:
    """PaddleOCR 3's English text pipeline, detection and recognition (no document unwarping or orientation models; the
    text-line orientation model where `angle_classifier`)."""
    try:
        from paddleocr import PaddleOCR
    except ImportError:
        raise ImportError("reward 'ocr' with engine: paddleocr needs PaddleOCR 3 and PaddlePaddle: pip install paddlepaddle paddleocr "
                          "(or the default engine, rapidocr, which ships its models)") from None
    if not hasattr(PaddleOCR, "predict"):
        raise ImportError("reward 'ocr' with engine: paddleocr needs PaddleOCR ≥ 3 (its predict API): pip install -U paddleocr")
    return PaddleOCR(lang="en", use_doc_orientation_classify=False, use_doc_unwarping=False, use_textline_orientation=angle_classifier)
