"""Which of the user's callbacks run on this rank, and with what paths.

Callbacks that only write (CSVLogger, the progress bar, TensorBoard unless asked for on
all ranks) run on the master rank alone. ``ModelCheckpoint`` runs on every rank: its saves
are collective (the master writes, every rank waits), so all ranks must reach them at the
same moments. Keras creates the checkpoint's directory itself before saving, though, and
two ranks doing that at once on a shared file system race (``FileExistsError``). On the
other ranks the checkpoint therefore points into a private scratch directory for the
duration of the call; the master alone touches the user's directories.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence

import keras

from .runtime import get_rank, is_master_rank

_MASTER_ONLY_CALLBACKS = (keras.callbacks.CSVLogger, keras.callbacks.ProgbarLogger)


def _runs_here(callback: keras.callbacks.Callback, tensorboard_on_all_ranks: bool) -> bool:
    if isinstance(callback, _MASTER_ONLY_CALLBACKS):
        return False
    if isinstance(callback, keras.callbacks.TensorBoard):
        return tensorboard_on_all_ranks
    return True


@contextlib.contextmanager
def callbacks_for_rank(
    callbacks: Sequence[keras.callbacks.Callback] | None, *, tensorboard_on_all_ranks: bool
) -> Iterator[list | None]:
    """Yield the callbacks this rank runs; non-master checkpoints write into scratch."""
    if callbacks is None or is_master_rank():
        yield callbacks
        return
    keep = [cb for cb in callbacks if _runs_here(cb, tensorboard_on_all_ranks)]
    checkpoints = [cb for cb in keep if isinstance(cb, keras.callbacks.ModelCheckpoint)]
    if not checkpoints:
        yield keep
        return
    saved = [(cb, cb.filepath, cb.verbose) for cb in checkpoints]
    with tempfile.TemporaryDirectory(prefix=f"tnt-rank{get_rank()}-checkpoint-") as scratch:
        for cb, filepath, _ in saved:
            # Keep the placeholders ({epoch}, ...) and the suffix: Keras formats the name
            # and checks the suffix as on the master; only the directory is private.
            cb.filepath = os.path.join(scratch, filepath.replace("://", "/").lstrip("/"))
            cb.verbose = 0
        try:
            yield keep
        finally:
            for cb, filepath, verbose in saved:
                cb.filepath, cb.verbose = filepath, verbose
