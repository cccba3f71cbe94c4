"""Loading a model quietly: the libraries' notices and progress bars held back while weights load."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_loading() -> Iterator[None]:
    """diffusers', transformers' and the hub client's warnings (deprecations, "couldn't connect to the
    Hub") and their loading progress bars are held back while a model loads: a failure is reported
    as one line instead, and the command's own output is all a user sees."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    names = ("diffusers", "transformers", "huggingface_hub")
    levels = {name: logging.getLogger(name).level for name in names}
    bars = [(module, module.is_progress_bar_enabled()) for module in (diffusers_logging, transformers_logging)]
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    for module, _ in bars:
        module.disable_progress_bar()
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        for module, enabled in bars:
            if enabled:
                module.enable_progress_bar()
