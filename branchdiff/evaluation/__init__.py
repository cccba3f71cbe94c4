"""Evaluation: sampling a prompt set with fixed seeds, scoring it with rewards, and the tables,
grids and files a user reads (`evaluate`).

May import: report, objectives, explore, search, settings, rewards, core, models, schedulers, runtime, data, errors.
"""
