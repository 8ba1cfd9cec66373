"""_core/serial_updates: an optimizer's traced updates run one variable after another,
bitwise as Keras' own."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tarantella._core.serial_updates import update_one_variable_at_a_time


def _variables(seed: int) -> list[keras.Variable]:
    rng = np.random.default_rng(seed)
    return [keras.Variable(rng.normal(size=shape).astype("float32")) for shape in ((64, 32), (32,), (32, 8))]


def _gradients(step: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return [rng.normal(size=shape).astype("float32") for shape in ((64, 32), (32,), (32, 8))]


def _train(make_optimizer, chained: bool, steps: int = 3) -> tuple[list[np.ndarray], tf.types.experimental.ConcreteFunction]:
    variables = _variables(0)
    optimizer = make_optimizer()
    if chained:
        update_one_variable_at_a_time(optimizer)
    optimizer.build(variables)
    step = tf.function(lambda grads: optimizer.apply(grads, variables), autograph=False)
    for i in range(steps):
        step([tf.constant(g) for g in _gradients(i)])
    concrete = step.get_concrete_function([tf.TensorSpec(g.shape, tf.float32) for g in _gradients(0)])
    return [v.numpy() for v in variables], concrete


OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd_momentum": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    "adamw_clip": lambda: keras.optimizers.AdamW(1e-2, global_clipnorm=0.5),
    "loss_scaled": lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_chained_updates_are_bitwise_keras_own(name):
    plain, _ = _train(OPTIMIZERS[name], chained=False)
    chained, _ = _train(OPTIMIZERS[name], chained=True)
    for a, b in zip(plain, chained):
        np.testing.assert_array_equal(a, b)


def _gradient_gates(concrete) -> int:
    """Identity ops on a gradient with a control input: one per variable after the first."""
    ops = concrete.graph.get_operations()
    return sum(1 for op in ops if op.type == "Identity" and op.control_inputs
               and op.inputs[0].shape.rank in (1, 2))


def test_each_update_waits_for_the_previous_variable():
    _, unchained = _train(OPTIMIZERS["adam"], chained=False, steps=1)
    _, chained = _train(OPTIMIZERS["adam"], chained=True, steps=1)
    assert _gradient_gates(unchained) == 0
    assert _gradient_gates(chained) == 2  # 3 variables: the 2nd waits for the 1st, the 3rd for the 2nd


def test_chaining_twice_is_chaining_once():
    optimizer = keras.optimizers.Adam()
    update_one_variable_at_a_time(optimizer)
    step = optimizer.update_step
    assert update_one_variable_at_a_time(optimizer).update_step is step
