"""Data replicas of a tensor group (ParallelStrategy.ALL, N = replicas x t).

Every rank of a tensor group reads the same *replica batch*: its replica's slice of each
global batch, cut as the data-parallel path cuts a batch over ranks (``tnt_data``, sample
level, sizes differ by at most one), with ``Sharding(rank=replica, size=replicas)``. The
step is the data-parallel one (``_steps.DistributedSteps``) run on the wrapper itself:
the loss is weighted by ``b_r / B``, and the gradients of shards and of replicated
variables, the batch size and the metric states are SUM-reduced by the fused engine on
the *replica group* (the ranks holding the same shard), never over the tensor group,
whose ranks already agree (at ``sharding=1|2`` DATA's ``Sharding`` on the replica group:
each rank applies the optimizer to the variables it owns there, level 2 reduce-scatters
the dense gradients, and the updated values are allgathered). The engine waits for backprop to end (its tensor-group
collectives run inside backprop; never two kinds at once). Predictions are gathered
over the replica group, so every rank returns the whole global batch's in order.
Callbacks run as in data parallelism: BackupAndRestore writes from the master and every
rank reads its slices of the backup (``_backup``); ModelCheckpoint and other writing
callbacks run on every rank (their saves are collective) with only the master writing
(``_rank_callbacks``).
"""

from __future__ import annotations

import keras

from .._core import backup as _backup
from .._core import sync as _sync
from .._core.inputs import Sharding, at_epoch, fit_datasets, rank_dataset
from ..data_parallel import DistributedSteps


class ReplicaLoops:
    """fit / evaluate / predict of a tensor-parallel model with data replicas (a mixin of
    TensorParallelModel: ``_tnt_replicas``, ``num_replicas``, ``replica``)."""

    def _replica_steps(self) -> DistributedSteps | None:
        if self._tnt_replicas is None:
            return None
        return DistributedSteps(self, self.num_replicas, self._tnt_settings.fusion_threshold_bytes,
                                comm=self._tnt_replicas, own_steps=False, in_graph_collectives=True,
                                sharding=self._tnt_sharding)

    def _sharding(self) -> Sharding:
        """Both ranks of a tensor group read their replica's slice of each global batch."""
        return Sharding(rank=self.replica, size=self.num_replicas, shuffle_seed=self._common_seed())

    def _replica_data(self, x, y=None, sample_weight=None, *, batch_size, shuffle, method):
        return rank_dataset(x, y, sample_weight, batch_size=batch_size, shuffle=shuffle, method=method,
                            sharding=self._sharding())

    def _fit_replicas(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
                      validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
                      sample_weight=None, initial_epoch=0, validation_batch_size=None, **kwargs):
        """Keras' fit on this replica's slice of every global batch (``x`` batched with the
        global batch size, or arrays with ``batch_size``)."""
        train, val = fit_datasets(
            x, y, sample_weight, sharding=self._sharding(), batch_size=batch_size, shuffle=shuffle,
            class_weight=class_weight, validation_split=validation_split, validation_data=validation_data,
            validation_batch_size=validation_batch_size)
        with self._per_call():  # level 3: building the metrics may run a forward pass
            _sync.build_variables(self, self, train, with_metrics=True)
        callbacks, backup = _backup.adapt(callbacks)
        if backup is not None:  # every rank reads its slices of the backup
            restored = backup.restore(self)
            if restored is not None:
                initial_epoch = restored
        if initial_epoch > 0:  # the shuffle order of that epoch in an uninterrupted run
            train = at_epoch(train, x, initial_epoch, kwargs.get("steps_per_epoch"))
        with self._rank_callbacks(callbacks) as rank_callbacks:
            return keras.Model.fit(self, train, epochs=epochs, verbose=self._verbose(verbose),
                                   callbacks=rank_callbacks, validation_data=val, shuffle=False,
                                   initial_epoch=initial_epoch, **kwargs)

    def _evaluate_replicas(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                           steps=None, callbacks=None, return_dict=False, **kwargs):
        """Keras' evaluate over the union of the replicas' slices (global metrics)."""
        data = self._replica_data(x, y, sample_weight, batch_size=batch_size, shuffle=False, method="evaluate")
        _sync.build_variables(self, self, data, with_metrics=True)
        return keras.Model.evaluate(self, data, verbose=self._verbose(verbose), steps=steps,
                                    callbacks=callbacks, return_dict=return_dict, **kwargs)

    def _predict_replicas(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        """Keras' predict; every rank returns the whole predictions in input order."""
        data = self._replica_data(x, batch_size=batch_size, shuffle=False, method="predict")
        if not self.compiled:
            keras.Model.compile(self, optimizer=None, loss=None, jit_compile=False)
        _sync.build_variables(self, self, data, with_metrics=False)
        return keras.Model.predict(self, data, verbose=self._verbose(verbose), steps=steps, callbacks=callbacks)
