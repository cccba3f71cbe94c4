"""Pretrain a built-in tiny model on rendered ground truth of its grammar: `--task tiny`, the image
model (assets/tiny), or `--task tiny-video`, the video model (assets/tiny-video, 5-frame clips).

Flow matching with an x0-prediction loss: x_σ = (1-σ)·x0 + σ·ε, σ ~ U(0, 1), loss ‖x̂0 - x0‖².
The text encoder trains jointly. Every `--eval-every` steps the EMA weights sample the held-out
prompts (ODE, fixed seeds) and are scored with the task's verifier (tiny-geneval, tiny-video); training stops once held-out strict
accuracy reaches `--target` (default 0.35: low enough to leave room for RL), and the
EMA weights of that evaluation are saved.

    python scripts/pretrain_tiny.py --out assets/tiny --max-minutes 12
    python scripts/pretrain_tiny.py --task tiny-video --out assets/tiny-video --max-minutes 20
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import numpy as np
import torch
from diffusers.training_utils import EMAModel

from branchdiff.data import tiny_task, tiny_video_task
from branchdiff.data.prompts import PromptSet
from branchdiff.evaluation.evaluate import evaluate, summarize
from branchdiff.models.tiny import TinyAdapter
from branchdiff.models.tiny_video import TinyVideoAdapter
from branchdiff.rewards.tiny_geneval import TinyGenEval
from branchdiff.rewards.tiny_video import TinyVideoVerifier

TASKS = {  # task: (adapter class, grammar and renderer, verifier)
    "tiny": (TinyAdapter, tiny_task, TinyGenEval),
    "tiny-video": (TinyVideoAdapter, tiny_video_task, TinyVideoVerifier),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(TASKS), default="tiny")
    parser.add_argument("--out", type=Path, default=None, help="default: assets/<task>")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--ema-decay", type=float, default=0.995)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-steps", type=int, default=10, help="ODE sampling steps at evaluation")
    parser.add_argument("--target", type=float, default=0.35, help="stop at this held-out strict accuracy")
    parser.add_argument("--max-minutes", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, default=None, help="continue from a saved tiny model directory")
    args = parser.parse_args()
    adapter_class, task, verifier = TASKS[args.task]
    args.out = args.out or Path("assets") / args.task

    adapter = adapter_class.from_pretrained(args.init) if args.init else adapter_class.random(seed=args.seed)
    adapter.text_encoder.requires_grad_(True).train()
    modules = torch.nn.ModuleList([adapter.denoiser, adapter.text_encoder])
    optimizer = torch.optim.AdamW(modules.parameters(), lr=args.lr, weight_decay=0.0)
    ema = EMAModel(modules.parameters(), decay=args.ema_decay, use_ema_warmup=True)
    train_prompts, held_out = task.split_prompts()
    rng = np.random.default_rng(args.seed)
    history = []
    start = time.time()
    for step in range(1, 10**9):
        prompts = [train_prompts[i] for i in rng.integers(0, len(train_prompts), args.batch_size)]
        x0 = adapter.encode_images(torch.from_numpy(task.render_batch(prompts, seed=int(rng.integers(2**31)))))
        noise = torch.randn_like(x0)
        sigmas = torch.rand(args.batch_size)
        sigma_rows = sigmas.reshape(-1, *[1] * (x0.dim() - 1))
        x_sigma = (1 - sigma_rows) * x0 + sigma_rows * noise
        x0_hat = adapter.predict_x0(x_sigma, sigmas, adapter.text_features([p.text for p in prompts]))
        loss = torch.nn.functional.mse_loss(x0_hat, x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(modules.parameters(), 1.0)
        optimizer.step()
        ema.step(modules.parameters())
        minutes = (time.time() - start) / 60
        if step % args.eval_every == 0 or minutes > args.max_minutes:
            ema_adapter = copy.deepcopy(adapter)
            ema.copy_to(torch.nn.ModuleList([ema_adapter.denoiser, ema_adapter.text_encoder]).parameters())
            prompt_set = PromptSet(f"{args.task}:held_out", [p.text for p in held_out], [{} for _ in held_out])
            summary = summarize(evaluate(ema_adapter, prompt_set, {"partial": verifier()}, 4, args.eval_steps))["all"]
            scores = {name.removeprefix("partial."): row["mean"] for name, row in summary.items()}
            history.append({"step": step, "minutes": round(minutes, 2), "loss": loss.item(), **scores})
            print(json.dumps(history[-1]), flush=True)
            if scores["strict"] >= args.target or minutes > args.max_minutes:
                ema_adapter.text_encoder.requires_grad_(False).eval()
                ema_adapter.save_pretrained(args.out)
                (args.out / "pretraining.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "history": history}, indent=1))
                print(f"saved {args.out} (held-out strict {scores['strict']:.3f})")
                return


if __name__ == "__main__":
    torch.set_num_threads(2)
    main()
