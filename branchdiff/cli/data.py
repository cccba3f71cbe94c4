"""`branchdiff data fetch NAME... | list`: the public prompt sets of branchdiff/data/datasets.py, fetched ahead of
time (a cluster offline at run time) and listed with their state."""

from __future__ import annotations

import argparse


def cmd_data(args: argparse.Namespace) -> None:
    from branchdiff.data.datasets import DATASETS, data_root, data_set, fetch, folder_of, status

    if args.data_command == "fetch":
        names = list(DATASETS) if args.names == ["all"] else args.names
        for name in names:
            data_set(name)  # every name checked before anything downloads
        for name in names:
            paths = fetch(name)
            print(f"{name}: {len(paths)} file(s) checked in {folder_of(name)}")
        return
    print(f"data sets (in {data_root()}; $BRANCHDIFF_DATA moves them)")
    for name, entry in DATASETS.items():
        print(f"\n{name}: {entry.about}\n  source {entry.repository} at {entry.commit[:12]}; licence: {entry.licence}")
        for file, state in status(name):
            rows = f", {file.rows:,} prompts" if file.rows else ""
            print(f"  {file.name:<28} {state}{rows}")
