"""The training recipe: a run around the iterations (`run`), the iteration itself (`trainer`) and its
checkpoints (`checkpoints`), optimizer steps for any objective (`update`), the learning rate over the
run (`lr_schedule`), the logged metrics (`metrics`), the reward-hacking watch (`hacking`), inputs
checked before anything is written (`preflight`) and a reward's signal check (`signal_check`).

May import: every layer below it (evaluation, report, objectives, explore, settings, search,
rewards, core, models, schedulers, runtime, data, errors); only bench and cli import it.
"""
