"""Rewards: the protocol (`base`: `reward(images, prompts, metadata) -> scores`), the registry of
names, dotted paths and entry points (`registry`), combining several (`combine`, `multi`), reward
servers (`server`, `remote`) and the built-ins (tiny-geneval, HPSv2, PickScore, CLIP score,
aesthetic, ImageReward); docs/rewards.md.

May import: core (group statistics), data (the tiny task's grammar), runtime, errors; never
training, objectives or the command line.
"""
