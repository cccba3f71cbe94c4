"""`tiny-partial`: a hand-made partial proxy of a built-in task's verifier, the mean of some of its partial-credit terms.

A reward that scores part of what the verifier checks can be won without the rest. On the image task,
`terms: [count, color]` pays for the right number of objects in the right colour, wherever they are and whatever
their shape; on the video task, `terms: [count, color, shape]` pays for objects that stand still. Trained on such a
proxy, a run's verifier score (its `strict`, held out) measures reward hacking against a ground truth
(docs/hacking.md):

    reward = mean over a ∈ terms of partial_a

with partial_a the verifier's own term for attribute a (branchdiff/rewards/tiny_geneval.py: count, color, shape,
position; branchdiff/rewards/tiny_video.py: count, color, shape, direction). All four terms give the verifier's
`partial` exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from branchdiff.data import tiny_task, tiny_video_task
from branchdiff.data.tiny_task import check_grammar
from branchdiff.rewards import tiny_geneval, tiny_video

TASKS = {  # the verifier's name: (its terms, scores_and_terms, the prompt parser)
    "tiny-geneval": (tiny_geneval.ATTRIBUTES, tiny_geneval.scores_and_terms, tiny_task.parse_prompt),
    "tiny-video": (tiny_video.ATTRIBUTES, tiny_video.scores_and_terms, tiny_video_task.parse_prompt),
}


class PartialProxy:
    """The mean of `terms` of `task`'s verifier (module doc)."""

    name = "tiny-partial"
    higher_is_better = True

    def __init__(self, task: str = "tiny-geneval", terms: list[str] | tuple[str, ...] = ("count", "color"), device: str | torch.device = "cpu") -> None:
        if task not in TASKS:
            raise ValueError(f"tiny-partial: task {task!r} is not a built-in verifier; give one of {', '.join(TASKS)}")
        attributes, self.scores_and_terms, self.parse = TASKS[task]
        unknown = [term for term in terms if term not in attributes]
        if not terms or unknown or len(set(terms)) != len(terms):
            raise ValueError(f"tiny-partial: terms {list(terms)} must be one or more distinct terms of {task}'s verifier "
                             f"({', '.join(attributes)}), e.g. [count, color]")
        self.task, self.terms, self.device = task, tuple(terms), torch.device(device)
        self.video = task == "tiny-video"
        self.scale = f"mean of {task}'s partial-credit terms {', '.join(self.terms)}, in [0, 1]"

    @staticmethod
    def check_prompts(prompts: list[str], task: str = "tiny-geneval", **settings: object) -> None:
        """Refuse, before a run starts, a prompt outside the task's grammar (preflight calls it with the reward's settings)."""
        if task in TASKS:  # an unknown task is the constructor's one line
            check_grammar(prompts, TASKS[task][2])

    @staticmethod
    def scores_videos(task: str = "tiny-geneval", **settings: object) -> bool:
        """Whether the proxy with these settings scores clips (the video task's), read before anything is built."""
        return task == "tiny-video"

    def __call__(self, pixels: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        """Scores (B,) of images (B, 3, H, W) or clips (B, F, 3, H, W) in [0, 1]."""
        if pixels.shape[0] != len(prompts):
            raise ValueError(f"tiny-partial: got {pixels.shape[0]} samples for {len(prompts)} prompts")
        if pixels.dim() != (5 if self.video else 4):
            raise ValueError(f"tiny-partial on {self.task} scores {'clips (B, F, 3, H, W)' if self.video else 'images (B, 3, H, W)'}, "
                             f"got {tuple(pixels.shape)}")
        values = pixels.detach().float().clamp(0, 1).cpu().numpy()
        rows = [self.scores_and_terms(sample, self.parse(text))[1] for sample, text in zip(values, prompts)]
        return torch.tensor([float(np.mean([row[term] for term in self.terms])) for row in rows])
