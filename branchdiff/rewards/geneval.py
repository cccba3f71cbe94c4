"""`geneval`: GenEval's verdict on each image (Ghosh et al., NeurIPS 2023), from its prompt's metadata (the `geneval`
and `flow-grpo-geneval` prompt sets carry it: tag, include, exclude; docs/benchmarks.md).

The parts (each replaceable by keyword): a detector of the 80 COCO classes with instance masks, a CLIP colour
classifier, and GenEval's decision rules (branchdiff/rewards/geneval_rules.py, equal to its evaluator's on every
recorded case: tests/test_geneval.py).

- **Detector** (`detector`): a Mask2Former COCO instance model in transformers' classes, by default
  `facebook/mask2former-swin-small-coco-instance` (Swin-S: the architecture of GenEval's mmdetection checkpoint
  `mask2former_swin-s-p4-w7-224_lsj_8x2_50e_coco`; GenEval's own stack, mmdet 2.x with mmcv-full, does not install from
  the package index without a compiler). Its weights are Meta's release converted by transformers, not mmdetection's own
  training run, so a detection's score can differ from GenEval's; everything around the weights is the evaluator's:
  the image resized to a shortest side of 800 (longest at most 1333), normalised and padded with zeros to multiples of
  32 (bottom and right), mask logits
  resized back to the image bilinearly, the 100 best (query, class) pairs by class probability, each scored by that
  probability times the mean mask probability inside its binary mask (logit > 0), its box the mask's extent
  [x_min, y_min, x_max + 1, y_max + 1].
- **Colours** (`clip`, `clip_checkpoint`): open_clip's ViT-L-14 with OpenAI's weights, a zero-shot classifier over
  GenEval's ten colours with its three templates ("a photo of a {c} {object}", "a photo of a {c}-colored {object}",
  "a photo of a {c} object": each colour's text features normalised, averaged, normalised), on each detected object's
  crop: the object's mask over a #999 background, cropped to its box (rounded to whole pixels).

Per image: 1.0 when correct, else 0.0; `score` adds `partial`, the share of the prompt's clauses satisfied.
"""

from __future__ import annotations

import torch
from PIL import Image

from branchdiff.rewards.base import to_uint8
from branchdiff.rewards.geneval_rules import COLORS, Detection, judge, keep_detections
from branchdiff.rewards.model_reward import MissingWeightsError, first_line, load_pretrained

DETECTOR = "facebook/mask2former-swin-small-coco-instance"
TEMPLATES = ("a photo of a {c} {classname}", "a photo of a {c}-colored {classname}", "a photo of a {c} object")
BACKGROUND = (153, 153, 153)  # "#999", behind a masked object's crop
MAX_PER_IMAGE = 100  # (query, class) pairs kept per image


class Mask2FormerDetector:
    """COCO instance detections of a Mask2Former in transformers' classes, post-processed as mmdetection's Mask2Former
    head does (module doc): `__call__(image)` → (boxes per class, masks per class)."""

    def __init__(self, path: str = DETECTOR, device: str | torch.device = "cpu", shortest_edge: int = 800, longest_edge: int = 1333) -> None:
        from transformers import Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor

        self.device = torch.device(device)
        origin = f"https://huggingface.co/{DETECTOR}"
        self.model = load_pretrained(Mask2FormerForUniversalSegmentation.from_pretrained, path, reward="geneval", what="detector",
                                     origin=origin).to(self.device).eval().requires_grad_(False)
        # resized only: transformers' size_divisor stretches to a multiple of 32, where mmdetection pads (`network_input`)
        sizes = {"size": {"shortest_edge": shortest_edge, "longest_edge": longest_edge}, "size_divisor": 0, "do_reduce_labels": False}
        self.processor = load_pretrained(lambda source: Mask2FormerImageProcessor.from_pretrained(source, **sizes), path, reward="geneval",
                                         what="detector's image processor", origin=origin)
        self.num_classes = self.model.config.num_labels

    def network_input(self, image: Image.Image) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """The image resized (shortest side to `shortest_edge`, longest at most `longest_edge`) and normalised by the
        processor, then padded with zeros at the bottom and right to multiples of 32 as mmdetection's Pad does after its
        Normalize: (pixels (1, 3, H', W'), mask (1, H', W') of the real pixels, the resized (h, w))."""
        pixels = self.processor(images=image, return_tensors="pt")["pixel_values"]  # (1, 3, h, w)
        height, width = pixels.shape[-2:]
        padded = (-(-height // 32) * 32, -(-width // 32) * 32)
        pixels = torch.nn.functional.pad(pixels, (0, padded[1] - width, 0, padded[0] - height))
        mask = torch.zeros(1, *padded, dtype=torch.long)
        mask[:, :height, :width] = 1
        return pixels.to(self.device), mask.to(self.device), (height, width)

    @torch.no_grad()
    def __call__(self, image: Image.Image) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """Boxes (N_c, 5) and masks (N_c of (H, W) bool) for each class c of a PIL image."""
        pixels, pixel_mask, resized = self.network_input(image)
        outputs = self.model(pixel_values=pixels, pixel_mask=pixel_mask)
        height, width = image.size[1], image.size[0]
        logits = torch.nn.functional.interpolate(outputs.masks_queries_logits, size=pixels.shape[-2:], mode="bilinear", align_corners=False)
        logits = logits[..., : resized[0], : resized[1]]  # the padding cut off
        logits = torch.nn.functional.interpolate(logits, size=(height, width), mode="bilinear", align_corners=False)[0]  # (Q, H, W)
        probabilities = outputs.class_queries_logits[0].softmax(-1)[:, :-1]  # (Q, C) without "no object"
        scores, flat = probabilities.flatten().topk(min(MAX_PER_IMAGE, probabilities.numel()), sorted=False)
        labels, queries = flat % self.num_classes, flat // self.num_classes
        masks = logits[queries] > 0  # (K, H, W)
        mask_scores = (logits[queries].sigmoid() * masks).flatten(1).sum(1) / (masks.flatten(1).sum(1) + 1e-6)
        scores = scores * mask_scores
        boxes = torch.stack([mask_box(mask) for mask in masks]) if len(masks) else torch.zeros(0, 4)
        per_class_boxes, per_class_masks = [], []
        for label in range(self.num_classes):
            chosen = (labels == label).nonzero().flatten()
            per_class_boxes.append(torch.cat([boxes[chosen], scores[chosen, None]], dim=1).cpu())
            per_class_masks.append([masks[i].cpu() for i in chosen.tolist()])
        return per_class_boxes, per_class_masks


def mask_box(mask: torch.Tensor) -> torch.Tensor:
    """[x_min, y_min, x_max + 1, y_max + 1] of a (H, W) bool mask; zeros for an empty one (mmdetection's mask2bbox)."""
    columns, rows = mask.any(0).nonzero().flatten(), mask.any(1).nonzero().flatten()
    if not len(columns) or not len(rows):
        return torch.zeros(4)
    return torch.tensor([columns[0], rows[0], columns[-1] + 1, rows[-1] + 1], dtype=torch.float32)


class ColourClassifier:
    """GenEval's zero-shot colour of each detected object (module doc), with an open_clip model."""

    def __init__(self, architecture: str = "ViT-L-14", checkpoint: str = "openai", device: str | torch.device = "cpu") -> None:
        import open_clip

        self.device = torch.device(device)
        try:
            self.model, _, self.transform = open_clip.create_model_and_transforms(architecture, pretrained=checkpoint, device=self.device)
        except Exception as error:  # unknown architecture, offline, a damaged file: one line naming what to give
            raise MissingWeightsError(f"reward 'geneval': cannot load the colour classifier open_clip {architecture} {checkpoint!r} "
                                      f"({first_line(error)}); pass clip_checkpoint= a local open_clip checkpoint of {architecture} "
                                      "(OpenAI's weights), or go online once") from error
        self.model.eval().requires_grad_(False)
        self.tokenizer = open_clip.get_tokenizer(architecture)
        self.weights: dict[str, torch.Tensor] = {}  # class name → (D, colours)

    @torch.no_grad()
    def classifier(self, classname: str) -> torch.Tensor:
        if classname not in self.weights:
            columns = []
            for colour in COLORS:
                tokens = self.tokenizer([t.format(c=colour, classname=classname) for t in TEMPLATES]).to(self.device)
                features = torch.nn.functional.normalize(self.model.encode_text(tokens), dim=-1).mean(0)
                columns.append(features / features.norm())
            self.weights[classname] = torch.stack(columns, dim=1)
        return self.weights[classname]

    @torch.no_grad()
    def __call__(self, image: Image.Image, classname: str, found: list[Detection]) -> list[str]:
        crops = []
        for detection in found:
            crop = image
            if detection.mask is not None:
                mask = Image.fromarray(detection.mask.numpy() if hasattr(detection.mask, "numpy") else detection.mask)
                crop = Image.composite(image, Image.new("RGB", image.size, BACKGROUND), mask)
            crops.append(self.transform(crop.crop(tuple(int(round(v)) for v in detection.box[:4]))))
        features = torch.nn.functional.normalize(self.model.encode_image(torch.stack(crops).to(self.device)), dim=-1)
        return [COLORS[i] for i in (features @ self.classifier(classname)).argmax(1).tolist()]


class GenEvalReward:
    """GenEval's verdicts (module doc). `classes`: the detector's 80 class names in its label order (default: GenEval's
    object_names.txt, from the `geneval` data set); `detector_shortest_edge`: the side images are resized to for the
    detector (the evaluator's 800; the tests' tiny detector takes less)."""

    name = "geneval"
    scale = "1 when the image satisfies its prompt's GenEval metadata (objects, count, colour, position), else 0"
    higher_is_better = True
    reward_key = "geneval"  # the key of `score` that is the reward; `partial` is reported beside it
    score_keys = ("geneval", "partial")

    def __init__(self, detector: str = DETECTOR, clip: str = "ViT-L-14", clip_checkpoint: str = "openai", classes: list[str] | None = None,
                 device: str | torch.device = "cpu", detector_shortest_edge: int = 800) -> None:
        if classes is None:
            from branchdiff.data.datasets import cached_path

            classes = cached_path("geneval", "object_names.txt").read_text().splitlines()
        self.classes = list(classes)
        self.device = torch.device(device)
        self.detect = Mask2FormerDetector(detector, device, detector_shortest_edge)
        if self.detect.num_classes != len(self.classes):
            raise ValueError(f"reward 'geneval': the detector {detector} names {self.detect.num_classes} classes and classes= lists "
                             f"{len(self.classes)}; give the detector's class names in its label order")
        self.colours = ColourClassifier(clip, clip_checkpoint, device)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, torch.Tensor]:
        correct, partial = [], []
        for pixels, row in zip(to_uint8(images).cpu(), metadata):
            if "include" not in row or "tag" not in row:
                raise ValueError("reward 'geneval' scores prompts with GenEval metadata (tag, include, exclude): use the prompt set "
                                 "geneval or flow-grpo-geneval:train|test, or a JSONL file of that form")
            image = Image.fromarray(pixels.permute(1, 2, 0).numpy())
            boxes, masks = self.detect(image)
            masks_np = [[None if m is None else m.numpy() for m in ms] for ms in masks]  # a detector may give boxes only
            detected = keep_detections([b.numpy() for b in boxes], masks_np, self.classes, row["tag"])
            ok, reasons = judge(row, detected, lambda classname, found, image=image: self.colours(image, classname, found))
            clauses = len(row.get("include", [])) + len(row.get("exclude", []))
            correct.append(float(ok))
            partial.append(1.0 - len(reasons) / clauses if clauses else float(ok))
        return {"geneval": torch.tensor(correct), "partial": torch.tensor(partial)}

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        return self.score(images, prompts, metadata)["geneval"]
