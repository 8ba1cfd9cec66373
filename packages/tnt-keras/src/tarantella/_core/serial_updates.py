"""An optimizer's variable updates run one after another inside a traced step.

Keras' optimizers update each variable with a few ops that make full-size temporaries
(Adam: ``g - m``, ``g²``, ``g² - v``, ``√v + ε``, ``m * alpha``, their quotient). Inside a
``tf.function`` the updates of different variables are independent, so TensorFlow's
executor interleaves them and the temporaries of every variable can be alive at once: on a
pipeline stage of a 92 M-parameter MLP this was the largest part of the stage's peak above
its own state (docs/memory.md). ``update_one_variable_at_a_time(optimizer)`` makes each
variable's update wait for the previous variable's to finish (a control dependency on the
previous variable read after its update), so at most one variable's temporaries exist. The
arithmetic is unchanged: results are bitwise those of the unchained update.

Eagerly run updates are left alone (they already run one op at a time).

Used where a step's gradients are all held before the update (a pipeline stage's sums:
largest-stage peaks of benchmarks/memory.py's pp2 1151 -> 1055 MiB on rank 0, rank 1
unchanged at 1189). Not for DATA: there each update frees the fused bucket its gradient
arrived in, in arrival order; chained in variable order the update held every bucket
(dp2 measured 1401 -> 1674 MiB per rank, the same hour). Used at DATA's sharding=2, where
every owned sum has arrived (reduce-scatters during backprop) before the update, chained in
the values' bucket order (data_parallel/_sharding.py, Note [Level 2's update bucket by bucket]);
or, without global_clipnorm or a loss scale, in the reduce-scatters' order, each update as its
sum arrives (Note [Level 2's update during backprop]).
"""

from __future__ import annotations

import keras
import tensorflow as tf

_MARK = "_tnt_one_variable_at_a_time"


def update_one_variable_at_a_time(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """Chain ``optimizer``'s per-variable updates (in place; idempotent); returns it.

    A LossScaleOptimizer's updates are its inner optimizer's: that one is chained."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        update_one_variable_at_a_time(inner)
        return optimizer
    if getattr(optimizer, _MARK, False):
        return optimizer
    update_step = optimizer.update_step  # the bound method (the class's or a user's override)
    last: dict = {"graph": None, "done": None}

    def chained_update_step(gradient, variable, learning_rate):
        graph = tf.compat.v1.get_default_graph()
        if tf.executing_eagerly() or not isinstance(variable, tf.Variable):
            return update_step(gradient, variable, learning_rate)
        if last["graph"] is graph and last["done"] is not None:
            with tf.control_dependencies([last["done"]]):
                gradient = tf.identity(gradient)  # every op of this update reads the gradient first
        result = update_step(gradient, variable, learning_rate)
        # Read after the update (automatic control dependencies order the read after the
        # variable's assignments): the next variable's update starts when this one is done.
        last["graph"], last["done"] = graph, variable.read_value()
        return result

    optimizer.update_step = chained_update_step
    setattr(optimizer, _MARK, True)
    return optimizer
