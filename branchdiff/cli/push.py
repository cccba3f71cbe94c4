"""`branchdiff push RUN --repo-id ID [--private]`: the run's weights on the Hugging Face Hub with its model
card. The LoRA (`pytorch_lora_weights.safetensors`) goes to the repository's root, where
`pipe.load_lora_weights(ID)` finds it; a full fine-tuning's denoiser folder keeps its name
(`transformer/`, `unet/`, `transformer_2/`). Beside them: README.md (the card, its usage written for
ID), the newest sample grid, config.yaml and eval.json. One `huggingface_hub` upload of a staged folder; each
hub call waits at most --timeout seconds for the hub and is tried again while the hub is out of reach
(branchdiff/runtime/hub.py)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from branchdiff.errors import UserError

EXPORTS = ("lora", "transformer", "unet", "transformer_2")
MORE_TIME = "; give more seconds with --timeout"  # the end of the line of a hub that did not answer in time


def exported(run_dir: Path) -> str:
    """The export folder's name in RUN, or a one-line UserError."""
    for name in EXPORTS:
        if (run_dir / name).is_dir() and any((run_dir / name).iterdir()):
            return name
    raise UserError(f"{run_dir}: no exported weights (lora/ or transformer/, unet/); push the output_dir of a branchdiff train that ran to "
                    "its end (its last step exports them)")


def stage(run_dir: Path, repo_id: str, folder: Path) -> list[str]:
    """The files of the upload in `folder`; returns their paths in the repository."""
    from branchdiff.report.model_card import CARD, card_text
    from branchdiff.report.run_data import sample_grids

    export = exported(run_dir)
    if export == "lora":
        shutil.copytree(run_dir / export, folder, dirs_exist_ok=True)
    else:
        shutil.copytree(run_dir / export, folder / export)
    held_out, training = sample_grids(run_dir)
    grid = (held_out or training or [None])[-1]
    if grid:
        (folder / "samples").mkdir()
        shutil.copy2(grid[1], folder / "samples" / grid[1].name)
    for name in ("config.yaml", "eval.json"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, folder / name)
    (folder / CARD).write_text(card_text(run_dir, export, repo_id))
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def cmd_push(args: argparse.Namespace) -> None:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from branchdiff.runtime.hub import bound_hub_calls, call_hub

    run_dir = Path(args.run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir}: not a run folder (no config.yaml); pass the output_dir of branchdiff train")
    if args.repo_id.count("/") != 1:
        raise UserError(f"--repo-id {args.repo_id}: a hub repository is OWNER/NAME, e.g. my-name/flux-hps-branch-lora")
    with tempfile.TemporaryDirectory() as staging:
        files = stage(run_dir, args.repo_id, Path(staging))
        bound_hub_calls(args.timeout)
        api, what = HfApi(), f"push to {args.repo_id}"
        try:
            call_hub(lambda: api.create_repo(args.repo_id, private=args.private, exist_ok=True), what, MORE_TIME)
            commit = call_hub(lambda: api.upload_folder(folder_path=staging, repo_id=args.repo_id, commit_message=f"branchdiff push of {run_dir.name}"),
                              what, MORE_TIME)
        except HfHubHTTPError as error:
            raise UserError(f"push to {args.repo_id}: the hub refused ({str(error).splitlines()[0]}); log in with `hf auth login` or set "
                            "HF_TOKEN to a token that can write there") from None
    print(f"pushed {len(files)} files to https://huggingface.co/{args.repo_id} ({getattr(commit, 'oid', commit)})")
