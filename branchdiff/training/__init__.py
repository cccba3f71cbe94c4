"""The training recipe (`recipe`: setup, the loop over iterations, one iteration, the checkpoint, top to
bottom) and the parts it composes: the checkpointer (`checkpoints`), optimizer steps for any objective
(`update`), the exploration (`exploration`), the evaluations (`evaluation`), the optimizer (`optimizer`),
the learning rate over the run (`lr_schedule`), the logged metrics (`metrics`), what the loop decides
between iterations (`run_control`), the reward-hacking watch (`hacking`), inputs checked before anything
is written (`preflight`) and a reward's signal check (`signal_check`).

May import: every layer below it (evaluation, report, objectives, explore, settings, search,
rewards, core, models, schedulers, runtime, data, errors); only bench and cli import it.
"""
